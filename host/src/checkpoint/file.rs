//! Checkpoints as files in a directory: `checkpoint-<id>.json`, each written whole, private
//! to the user (see [`crate::private::write`]).

use std::path::{Path, PathBuf};

use async_trait::async_trait;

use crate::crash::{self, CrashPoint};
use crate::private;

use super::{Checkpoint, CheckpointError, CheckpointId, CheckpointStore};

const PREFIX: &str = "checkpoint-";
const SUFFIX: &str = ".json";

/// A [`CheckpointStore`] in a directory on local disk.
#[derive(Clone, Debug)]
pub struct FileCheckpoints {
    dir: PathBuf,
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> CheckpointError {
    move |source| CheckpointError::Io { context, source }
}

impl FileCheckpoints {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: CheckpointId) -> PathBuf {
        self.dir.join(format!("{PREFIX}{id:020}{SUFFIX}"))
    }

    fn ids(&self) -> Result<Vec<CheckpointId>, CheckpointError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(format!("listing {}", self.dir.display()))(e)),
        };
        let mut ids = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io(format!("listing {}", self.dir.display())))?;
            let name = entry.file_name();
            let id = name
                .to_str()
                .and_then(|n| n.strip_prefix(PREFIX))
                .and_then(|n| n.strip_suffix(SUFFIX))
                .and_then(|n| n.parse::<CheckpointId>().ok());
            ids.extend(id);
        }
        ids.sort_unstable();
        Ok(ids)
    }

    fn read(&self, id: CheckpointId) -> Result<Checkpoint, CheckpointError> {
        let path = self.path(id);
        let bytes = std::fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
        Checkpoint::decode(&bytes, &path.display().to_string())
    }

    fn sync_dir(&self) -> Result<(), CheckpointError> {
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io(format!("syncing {}", self.dir.display())))
    }

    fn save_now(&self, checkpoint: &Checkpoint, keep: usize) -> Result<(), CheckpointError> {
        let path = self.path(checkpoint.id);
        let bytes = checkpoint
            .encode(true)
            .map_err(|e| io(format!("encoding {}", path.display()))(std::io::Error::other(e)))?;
        private::write_staged(&path, &bytes, || crash::reached(CrashPoint::CheckpointSave))
            .map_err(io(format!("writing {}", path.display())))?;
        let ids = self.ids()?;
        let excess = ids.len().saturating_sub(keep.max(1));
        for &old in &ids[..excess] {
            let old = self.path(old);
            std::fs::remove_file(&old).map_err(io(format!("deleting {}", old.display())))?;
        }
        if excess > 0 {
            self.sync_dir()?;
        }
        Ok(())
    }
}

#[async_trait]
impl CheckpointStore for FileCheckpoints {
    async fn save(&self, checkpoint: &Checkpoint, keep: usize) -> Result<(), CheckpointError> {
        let this = self.clone();
        let checkpoint = checkpoint.clone();
        tokio::task::spawn_blocking(move || this.save_now(&checkpoint, keep))
            .await
            .map_err(|e| io("saving a checkpoint".to_owned())(std::io::Error::other(e)))?
    }

    async fn latest(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        // Only whole files are ever renamed into place, so the newest file is complete; a
        // file that does not parse was damaged afterwards, and is an error, not skipped.
        match self.ids()?.last() {
            Some(&id) => self.read(id).map(Some),
            None => Ok(None),
        }
    }

    async fn list(&self) -> Result<Vec<CheckpointId>, CheckpointError> {
        self.ids()
    }

    async fn oldest(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        match self.ids()?.first() {
            Some(&id) => self.read(id).map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::conformance::{Fresh, checkpoint};

    crate::checkpoint_conformance_tests!(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        Fresh {
            store: std::sync::Arc::new(FileCheckpoints::new(dir.path().join("checkpoints"))),
            guard: Box::new(dir),
        }
    });

    #[tokio::test]
    async fn a_temporary_file_left_by_a_crash_is_not_a_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileCheckpoints::new(dir.path());
        store.save(&checkpoint(1), 3).await.expect("save");
        // A crash between writing the temporary file and renaming it.
        std::fs::write(dir.path().join(".tmp-Ab3dE9"), b"{\"id\": 2, \"inp").expect("write");
        assert_eq!(store.latest().await.expect("latest"), Some(checkpoint(1)));
        assert_eq!(store.list().await.expect("list"), [1]);
    }

    #[tokio::test]
    async fn a_checkpoint_names_its_format_and_a_newer_one_is_refused_saying_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileCheckpoints::new(dir.path());
        store.save(&checkpoint(1), 3).await.expect("save");
        let text = std::fs::read_to_string(store.path(1)).expect("read");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(json["format"], 1, "{text}");
        std::fs::write(
            store.path(1),
            text.replacen("\"format\": 1", "\"format\": 9", 1),
        )
        .expect("write");
        let error = store.latest().await.expect_err("too new").to_string();
        assert!(
            error.contains(
                "checkpoint-00000000000000000001.json is format 9, and this build \
                 reads format 1 and older"
            ),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_damaged_checkpoint_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileCheckpoints::new(dir.path());
        store.save(&checkpoint(1), 3).await.expect("save");
        std::fs::write(store.path(1), b"not json").expect("damage");
        let error = store.latest().await.expect_err("unreadable");
        assert!(
            error
                .to_string()
                .contains("checkpoint-00000000000000000001.json"),
            "{error}"
        );
    }
}
