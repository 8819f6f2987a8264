//! A tenant's components: an upload is counted against the tenant's quotas, compiled in one
//! of the host's compile slots, checked against the world before anything is kept, and
//! stored under `components/NAME.wasm`. Its compiled form stays in the tenant's own cache
//! (`compiled/`, counted in its `stored-bytes`); the form of the component it replaces is
//! evicted when no agent version pins that one.

use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use sha2::Digest as _;

use super::compile::{Busy, CompileSlots};
use super::quota::QuotaExceeded;
use super::runtime::TenantRuntime;
use crate::private;
use crate::sandbox::LoadError;

/// Why an upload was not stored.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error(transparent)]
    Quota(#[from] QuotaExceeded),
    #[error(transparent)]
    Busy(#[from] Busy),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("storing the component: {0}")]
    Io(#[from] std::io::Error),
}

/// Checks `wasm` and stores it as component `name` of the tenant; its SHA-256, hex.
pub async fn upload(
    runtime: &TenantRuntime,
    slots: &CompileSlots,
    name: &str,
    wasm: bytes::Bytes,
) -> Result<String, UploadError> {
    runtime.check_storage(wasm.len() as u64)?;
    runtime.take_compile()?;
    let sha256 = hex::encode(sha2::Sha256::digest(&wasm));
    let origin = format!("component {name}");
    let sandbox = runtime.sandbox();
    {
        let _slot = slots.take().await?;
        let bytes = wasm.clone();
        // On the guests' runtime: parsing and validating it are below the server's
        // threads too (its functions compile on rayon's pool, lowered the same).
        runtime
            .compute()
            .spawn_blocking(move || sandbox.load(&origin, &bytes).map(drop))
            .await
            .map_err(|e| std::io::Error::other(format!("checking the component failed: {e}")))??;
    }
    let dir = runtime.dir().join("components");
    let path = dir.join(format!("{name}.wasm"));
    let replaced = unpinned_digest(&path);
    private::write(&path, &wasm)?;
    if let Some(old) = replaced.filter(|old| *old != sha256) {
        runtime.sandbox().cache().evict(&old);
    }
    Ok(sha256)
}

/// The SHA-256 of the component at `path` when no agent version pins it (versions pin a
/// component by a hard link to its file, so that file has one link only).
fn unpinned_digest(path: &Path) -> Option<String> {
    let metadata = std::fs::metadata(path).ok()?;
    if metadata.nlink() > 1 {
        return None;
    }
    let bytes = std::fs::read(path).ok()?;
    Some(hex::encode(sha2::Sha256::digest(bytes)))
}
