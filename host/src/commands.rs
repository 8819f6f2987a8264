//! Operator commands on a state that a process may be running: retry or skip a parked
//! input, answer a call of it left in doubt and retry it, or cancel an input. A command is
//! left where the process that holds the state (or, when none does, the next one to open
//! it) finds it, carries it out, and records its outcome.
//!
//! In a state directory (`rewind run --state DIR`):
//!
//! ```text
//! DIR/commands/ID.json        a command not carried out yet (written whole: temp + rename)
//! DIR/commands/done/ID.json   one carried out or refused, with its outcome
//! ```
//!
//! IDs sort in the order the commands were left (microseconds since the epoch, then random
//! digits), and commands are carried out in that order. A command's effect is recorded in
//! its state (a skip or cancel in the next checkpoint) before it moves to `done/`, so a crash between
//! the two carries it out again, and finds it done. The newest [`KEEP_DONE`] done commands are
//! kept; older ones are deleted as new ones are done (their effects stay in the state).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::private;

/// The format of a command file; a file of another is refused, naming both.
pub const FORMAT: u32 = 1;

/// The largest command file: a key, a reason and who asked fit in far less; an answer for a
/// call in doubt (a model's reply) may take more.
pub const MAX_COMMAND_BYTES: u64 = 1024 * 1024;

/// Done commands kept in a state directory: once there are more, the oldest are deleted.
pub const KEEP_DONE: usize = 1000;

/// The longest reason kept, in bytes.
pub const MAX_REASON_BYTES: usize = 4096;

/// What an operator asks of a key's parked input.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verb", rename_all = "kebab-case")]
pub enum Verb {
    /// Run it again from its first attempt.
    Retry,
    /// Finish it without running it; the key's next input runs.
    Skip { reason: String },
    /// Stop it (running, retrying or parked) at its next durable call, which is not made,
    /// and finish it; the key's next input runs.
    Cancel {
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
    },
    /// Record what became of its call `call` (of `action`, when more than one has that
    /// call in doubt), then retry it.
    Resolve {
        call: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        action: Option<String>,
        answer: CallAnswer,
    },
    /// Deliver a signal to the input (without a sequence, to the key's first unfinished
    /// one), once per `id`.
    Signal {
        name: String,
        /// JSON text.
        payload: String,
        /// The sender's id for it: a signal sent again with the same id is delivered once.
        /// Empty: the command's id.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        signal_id: String,
    },
}

/// What became of a call in doubt, as an operator found out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CallAnswer {
    /// It ran, and answered this JSON (as text).
    Result(String),
    /// It ran, and failed with this error.
    Error(String),
    /// It never reached its function: made again, under the same idempotency key.
    NotMade,
}

impl Verb {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Skip { .. } => "skip",
            Self::Cancel { .. } => "cancel",
            Self::Resolve { .. } => "resolve",
            Self::Signal { .. } => "signal",
        }
    }
}

/// One operator command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Command {
    pub format: u32,
    pub id: String,
    pub key: String,
    /// The parked input's sequence; without it, whichever input of the key is parked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<u64>,
    /// Who asked.
    pub by: String,
    #[serde(flatten)]
    pub verb: Verb,
}

/// What came of a command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum Outcome {
    /// Carried out on the input of this sequence.
    Applied { sequence: u64 },
    /// Not carried out, and why (the key has no parked input, say).
    Refused { error: String },
}

/// A command carried out or refused: what `DIR/commands/done/` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Done {
    pub id: String,
    /// `None` for a file that was not a command this build reads (refused, saying why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Command>,
    #[serde(flatten)]
    pub outcome: Outcome,
    /// When it was done, in milliseconds since the epoch.
    pub at_ms: u64,
}

/// Why commands could not be left, read or moved.
#[derive(Debug, thiserror::Error)]
pub enum CommandsError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{what}: {message}")]
    Invalid { what: String, message: String },
    /// Where the commands are kept (a cluster's stream) did not answer, or failed.
    #[error("{what}: {source}")]
    Remote {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CommandsError + '_ {
    move |source| CommandsError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where a process takes the commands left for it, and says what came of each.
#[async_trait]
pub trait CommandQueue: Send + Sync + std::fmt::Debug {
    /// The commands not carried out yet, oldest first. One that cannot be read is moved
    /// to the done ones as refused, saying why, and not returned.
    async fn pending(&self) -> Result<Vec<Command>, CommandsError>;

    /// Records what came of `command`; it is no longer pending. Called only once its
    /// effect is recorded where recovery finds it.
    async fn finish(&self, command: &Command, outcome: &Outcome) -> Result<(), CommandsError>;
}

/// The commands of a state directory, `DIR/commands/`.
#[derive(Clone, Debug)]
pub struct CommandDir {
    dir: PathBuf,
}

impl CommandDir {
    /// The commands of the state directory `state`.
    pub fn of(state: &Path) -> Self {
        Self {
            dir: state.join("commands"),
        }
    }

    fn done_dir(&self) -> PathBuf {
        self.dir.join("done")
    }

    /// Leaves a command for `key` (its parked input `sequence`, or whichever is parked),
    /// asked by `by`. Returns it, with its id.
    pub fn submit(
        &self,
        key: &str,
        sequence: Option<u64>,
        by: &str,
        verb: Verb,
    ) -> Result<Command, CommandsError> {
        let command = Command::new(key, sequence, by, verb)?;
        let bytes = command.encode()?;
        private::create_private_dir(&self.dir).map_err(io(&self.dir))?;
        let path = self.dir.join(format!("{}.json", command.id));
        private::write(&path, &bytes).map_err(io(&path))?;
        Ok(command)
    }

    /// The commands not carried out yet, oldest first (see [`CommandQueue::pending`]).
    pub fn pending_now(&self) -> Result<Vec<Command>, CommandsError> {
        let mut commands = Vec::new();
        for (id, path) in json_files(&self.dir)? {
            match read_command(&path, &id) {
                Ok(command) => commands.push(command),
                Err(error) => {
                    tracing::warn!(path = %path.display(), "refusing a command: {error}");
                    let refused = Outcome::Refused {
                        error: error.to_string(),
                    };
                    self.move_done(&id, None, &refused)?;
                }
            }
        }
        Ok(commands)
    }

    /// Moves `command` to the done ones with `outcome`.
    pub fn finish_now(&self, command: &Command, outcome: &Outcome) -> Result<(), CommandsError> {
        self.move_done(&command.id, Some(command), outcome)
    }

    /// Writes the done file of `id`, removes its pending one, then deletes the oldest done
    /// files past [`KEEP_DONE`].
    fn move_done(
        &self,
        id: &str,
        command: Option<&Command>,
        outcome: &Outcome,
    ) -> Result<(), CommandsError> {
        let done = Done::new(id, command, outcome);
        let bytes =
            serde_json::to_vec_pretty(&done).map_err(|e| invalid("a command", &e.to_string()))?;
        let path = self.done_dir().join(format!("{id}.json"));
        private::write(&path, &bytes).map_err(io(&path))?;
        let pending = self.dir.join(format!("{id}.json"));
        match std::fs::remove_file(&pending) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&pending)(e)),
        }
        std::fs::File::open(&self.dir)
            .and_then(|dir| dir.sync_all())
            .map_err(io(&self.dir))?;
        let done = json_files(&self.done_dir())?;
        for (_, path) in &done[..done.len().saturating_sub(KEEP_DONE)] {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(path)(e)),
            }
        }
        Ok(())
    }

    /// What came of the command `id`, once it is done.
    pub fn outcome(&self, id: &str) -> Result<Option<Done>, CommandsError> {
        let path = self.done_dir().join(format!("{id}.json"));
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| invalid(&path.display().to_string(), &e.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&path)(e)),
        }
    }

    /// Every command done, oldest first. A file that cannot be read is named in the error.
    pub fn done(&self) -> Result<Vec<Done>, CommandsError> {
        json_files(&self.done_dir())?
            .into_iter()
            .map(|(id, _)| {
                self.outcome(&id)?
                    .ok_or_else(|| invalid(&id, "went while it was being read"))
            })
            .collect()
    }
}

#[async_trait]
impl CommandQueue for CommandDir {
    async fn pending(&self) -> Result<Vec<Command>, CommandsError> {
        let dir = self.clone();
        tokio::task::spawn_blocking(move || dir.pending_now())
            .await
            .unwrap_or_else(|e| Err(invalid("reading the commands", &e.to_string())))
    }

    async fn finish(&self, command: &Command, outcome: &Outcome) -> Result<(), CommandsError> {
        let (dir, command, outcome) = (self.clone(), command.clone(), outcome.clone());
        tokio::task::spawn_blocking(move || dir.finish_now(&command, &outcome))
            .await
            .unwrap_or_else(|e| Err(invalid("recording a command's outcome", &e.to_string())))
    }
}

fn invalid(what: &str, message: &str) -> CommandsError {
    CommandsError::Invalid {
        what: what.to_owned(),
        message: message.to_owned(),
    }
}

/// The `ID.json` files of `dir` (none when it is missing), by id.
fn json_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, CommandsError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(dir)(e)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(io(dir))?.path();
        let Some(id) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
            .filter(|id| !id.starts_with('.'))
        else {
            continue;
        };
        files.push((id.to_owned(), path));
    }
    files.sort();
    Ok(files)
}

fn read_command(path: &Path, id: &str) -> Result<Command, CommandsError> {
    let what = path.display().to_string();
    let size = std::fs::metadata(path).map_err(io(path))?.len();
    if size > MAX_COMMAND_BYTES {
        return Err(invalid(
            &what,
            &format!("{size} bytes, over the {MAX_COMMAND_BYTES} a command may take"),
        ));
    }
    let bytes = std::fs::read(path).map_err(io(path))?;
    Command::decode(&bytes, id, &what)
}

impl Command {
    /// A new command for `key` (its input `sequence`, or whichever the verb takes), asked
    /// by `by`, with a new id; refused, saying why, with an empty key or an overlong
    /// reason.
    pub fn new(
        key: &str,
        sequence: Option<u64>,
        by: &str,
        verb: Verb,
    ) -> Result<Self, CommandsError> {
        if key.is_empty() {
            return Err(invalid("the key", "is empty"));
        }
        if let Verb::Skip { reason } | Verb::Cancel { reason } = &verb
            && reason.len() > MAX_REASON_BYTES
        {
            return Err(invalid(
                "the reason",
                &format!(
                    "is {} bytes, over the {MAX_REASON_BYTES} kept",
                    reason.len()
                ),
            ));
        }
        Ok(Self {
            format: FORMAT,
            id: new_id(),
            key: key.to_owned(),
            sequence,
            by: by.to_owned(),
            verb,
        })
    }

    /// The command as it is left (JSON), refused past [`MAX_COMMAND_BYTES`].
    pub fn encode(&self) -> Result<Vec<u8>, CommandsError> {
        let bytes =
            serde_json::to_vec_pretty(self).map_err(|e| invalid("a command", &e.to_string()))?;
        if bytes.len() as u64 > MAX_COMMAND_BYTES {
            return Err(invalid(
                "the command",
                &format!(
                    "is {} bytes, over the {MAX_COMMAND_BYTES} a command may take",
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }

    /// The command `bytes` hold, left under `id` (`what` names where, in errors): of this
    /// build's format, its id `id`, its key not empty.
    pub fn decode(bytes: &[u8], id: &str, what: &str) -> Result<Self, CommandsError> {
        let format = serde_json::from_slice::<serde_json::Value>(bytes)
            .map_err(|e| invalid(what, &format!("not JSON: {e}")))?
            .get("format")
            .and_then(serde_json::Value::as_u64);
        if format != Some(u64::from(FORMAT)) {
            return Err(invalid(
                what,
                &format!(
                    "command format {}, where this build reads {FORMAT}: leave it again with \
                     this build's `rewind retry`, `skip`, `resolve` or `cancel`",
                    format.map_or_else(|| "missing".to_owned(), |f| f.to_string())
                ),
            ));
        }
        let command: Self = serde_json::from_slice(bytes)
            .map_err(|e| invalid(what, &format!("not a command: {e}")))?;
        if command.id != id {
            return Err(invalid(
                what,
                &format!("its id `{}` is not the one it was left under", command.id),
            ));
        }
        if command.key.is_empty() {
            return Err(invalid(what, "its key is empty"));
        }
        Ok(command)
    }
}

impl Done {
    /// `outcome` of the command `id` (`command`, when it could be read), now.
    pub fn new(id: &str, command: Option<&Command>, outcome: &Outcome) -> Self {
        Self {
            id: id.to_owned(),
            command: command.cloned(),
            outcome: outcome.clone(),
            at_ms: now_ms(),
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Microseconds since the epoch, then random digits: ids sort in the order they were made.
/// Within a process each id's time is past the one before (two commands left in one
/// microsecond, or across a step back of the clock, keep their order); between processes
/// the clock orders them. Ids of older releases (milliseconds, 13 digits) sort before these
/// of a later time: a `-` sorts before a digit.
fn new_id() -> String {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    let previous = LAST
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| {
            Some(now.max(last + 1))
        })
        .unwrap_or_else(|last| last);
    let micros = now.max(previous + 1);
    format!("{micros:016}-{:08x}", rand::random::<u32>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_is_left_read_back_in_order_and_finished_once() {
        let state = tempfile::tempdir().expect("tempdir");
        let commands = CommandDir::of(state.path());
        assert!(commands.pending_now().expect("none yet").is_empty());
        let skip = Verb::Skip {
            reason: "bad payload".to_owned(),
        };
        let first = commands.submit("k", Some(3), "alice", skip).expect("left");
        let second = commands
            .submit("j", None, "bob", Verb::Retry)
            .expect("left");
        let pending = commands.pending_now().expect("read");
        assert_eq!(pending, [first.clone(), second.clone()]);
        let outcome = Outcome::Applied { sequence: 3 };
        commands.finish_now(&first, &outcome).expect("finished");
        assert_eq!(commands.pending_now().expect("read"), [second]);
        let done = commands.outcome(&first.id).expect("read").expect("done");
        assert_eq!((done.command, done.outcome), (Some(first), outcome));
    }

    #[test]
    fn only_the_newest_done_commands_are_kept() {
        let state = tempfile::tempdir().expect("tempdir");
        let commands = CommandDir::of(state.path());
        let mut left = Vec::new();
        for i in 0..KEEP_DONE + 3 {
            let command = commands
                .submit(&format!("k{i}"), None, "alice", Verb::Retry)
                .expect("left");
            commands
                .finish_now(&command, &Outcome::Applied { sequence: 0 })
                .expect("finished");
            left.push(command);
        }
        let done = commands.done().expect("read");
        assert_eq!(done.len(), KEEP_DONE);
        assert_eq!(done[0].command.as_ref(), Some(&left[3]));
        assert!(commands.outcome(&left[2].id).expect("read").is_none());
        assert!(
            commands
                .outcome(&left[KEEP_DONE + 2].id)
                .expect("read")
                .is_some()
        );
    }

    /// Commands left one after another, many in one millisecond, are read back in the
    /// order they were left: an operator's resolve then retry are carried out in that order.
    #[test]
    fn commands_left_in_one_instant_keep_their_order() {
        let state = tempfile::tempdir().expect("tempdir");
        let commands = CommandDir::of(state.path());
        let left: Vec<Command> = (0..100)
            .map(|n| commands.submit("k", Some(n), "op", Verb::Retry))
            .collect::<Result<_, _>>()
            .expect("left");
        assert_eq!(commands.pending_now().expect("read"), left);
    }

    #[test]
    fn a_file_that_is_not_a_command_is_refused_saying_why() {
        let state = tempfile::tempdir().expect("tempdir");
        let commands = CommandDir::of(state.path());
        std::fs::create_dir_all(state.path().join("commands")).expect("mkdir");
        let old = r#"{"format": 9, "id": "1-a", "key": "k", "by": "x", "verb": "retry"}"#;
        std::fs::write(state.path().join("commands/1-a.json"), old).expect("write");
        std::fs::write(state.path().join("commands/2-b.json"), "{").expect("write");
        assert!(commands.pending_now().expect("read").is_empty());
        let done = commands.done().expect("done");
        let errors: Vec<String> = done
            .iter()
            .map(|d| match &d.outcome {
                Outcome::Refused { error } => error.clone(),
                Outcome::Applied { .. } => panic!("applied: {d:?}"),
            })
            .collect();
        assert!(
            errors[0].contains("command format 9") && errors[0].contains("reads 1"),
            "{errors:?}"
        );
        assert!(errors[1].contains("not JSON"), "{errors:?}");
    }

    #[test]
    fn an_empty_key_or_an_overlong_reason_is_refused() {
        let state = tempfile::tempdir().expect("tempdir");
        let commands = CommandDir::of(state.path());
        let error = commands
            .submit("", None, "a", Verb::Retry)
            .expect_err("empty key");
        assert!(error.to_string().contains("the key: is empty"), "{error}");
        let reason = "x".repeat(MAX_REASON_BYTES + 1);
        let error = commands
            .submit("k", None, "a", Verb::Skip { reason })
            .expect_err("long reason");
        assert!(error.to_string().contains("over the 4096 kept"), "{error}");
    }
}
