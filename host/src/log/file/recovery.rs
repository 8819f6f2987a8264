//! Opening a log directory: its format file, each partition's segments, and torn tails.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::entry::{self, Decoded};
use super::segment::{Partition, Segment, create_segment, segment_path, sync_dir};
use super::{Contents, FileLogOptions, Recovery};
use crate::log::{LogError, Offset};
use crate::{private, version};

/// The directory's format file.
const FORMAT_FILE: &str = "log.json";
const FORMAT: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
struct Format {
    format: u32,
    partitions: u32,
    /// What its records hold, in which format (logs written before it was named have
    /// none: their records are format 1 of whatever the opener expects).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    contents: Option<Named>,
}

/// [`Contents`] as `log.json` names them.
#[derive(Debug, Serialize, Deserialize)]
struct Named {
    kind: String,
    format: u32,
}

/// Bytes that recovery cut from the end of a partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Truncation {
    pub partition: u32,
    pub path: PathBuf,
    /// Where the last whole record ends; the file now ends here.
    pub at: u64,
    pub bytes: u64,
    /// What was found there: a record cut short, or bytes that are not a record.
    pub reason: String,
}

/// What opening the log found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    pub truncated: Vec<Truncation>,
    /// What the commit journal gave back to the partitions.
    pub journal: super::Replay,
}

impl OpenReport {
    /// Bytes dropped over all partitions.
    pub fn dropped_bytes(&self) -> u64 {
        self.truncated.iter().map(|t| t.bytes).sum()
    }
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> LogError {
    move |source| LogError::Io { context, source }
}

pub(super) fn open(
    dir: &Path,
    options: FileLogOptions,
) -> Result<(Vec<Partition>, OpenReport), LogError> {
    if options.recovery == Recovery::ReadOnly {
        if partitions_in(dir)?.is_none() {
            return Err(LogError::Corrupt {
                path: dir.display().to_string(),
                message: "no log here".to_owned(),
            });
        }
    } else {
        private::create_dir(dir).map_err(io(format!("creating {}", dir.display())))?;
    }
    check_format(dir, options.partitions, options.contents)?;
    // Partitions are scanned at once, on threads of their own: opening reads every byte.
    let opened: Vec<Result<(Partition, OpenReport), LogError>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..options.partitions)
            .map(|partition| {
                scope.spawn(move || {
                    let mut report = OpenReport::default();
                    open_partition(dir, partition, options.recovery, &mut report)
                        .map(|p| (p, report))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|thread| {
                thread.join().unwrap_or_else(|_| {
                    Err(LogError::Io {
                        context: format!("opening {}", dir.display()),
                        source: std::io::Error::other("a partition's scan panicked"),
                    })
                })
            })
            .collect()
    });
    let mut report = OpenReport::default();
    let mut partitions = Vec::new();
    for result in opened {
        let (partition, found) = result?;
        partitions.push(partition);
        report.truncated.extend(found.truncated);
    }
    Ok((partitions, report))
}

/// The partition count of the log in `dir`, or `None` when there is no log there.
pub(super) fn partitions_in(dir: &Path) -> Result<Option<u32>, LogError> {
    let path = dir.join(FORMAT_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice::<Format>(&bytes)
            .map(|f| Some(f.partitions))
            .map_err(|e| LogError::Corrupt {
                path: path.display().to_string(),
                message: format!("not a log format file: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(format!("reading {}", path.display()))(e)),
    }
}

fn check_format(dir: &Path, partitions: u32, contents: Option<Contents>) -> Result<(), LogError> {
    let path = dir.join(FORMAT_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let found: Format = serde_json::from_slice(&bytes).map_err(|e| LogError::Corrupt {
                path: path.display().to_string(),
                message: format!("not a log format file: {e}"),
            })?;
            if found.format != FORMAT {
                return Err(LogError::Corrupt {
                    path: path.display().to_string(),
                    message: format!(
                        "log format {} (this build reads format {FORMAT})",
                        found.format
                    ),
                });
            }
            if found.partitions != partitions {
                return Err(LogError::PartitionCount {
                    path: path.display().to_string(),
                    on_disk: found.partitions,
                    asked: partitions,
                });
            }
            if let (Some(wanted), Some(found)) = (contents, &found.contents) {
                let corrupt = |message: String| LogError::Corrupt {
                    path: path.display().to_string(),
                    message,
                };
                if found.kind != wanted.kind {
                    return Err(corrupt(format!(
                        "a log of {}, not of {}",
                        found.kind, wanted.kind
                    )));
                }
                let what = format!("this {} log", found.kind);
                version::check(found.format, wanted.format, &what)
                    .map_err(|e| corrupt(e.to_string()))?;
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let bytes = serde_json::to_vec(&Format {
                format: FORMAT,
                partitions,
                contents: contents.map(|c| Named {
                    kind: c.kind.to_owned(),
                    format: c.format,
                }),
            })
            .map_err(|e| io(format!("writing {}", path.display()))(std::io::Error::other(e)))?;
            private::write(&path, &bytes).map_err(io(format!("writing {}", path.display())))
        }
        Err(e) => Err(io(format!("reading {}", path.display()))(e)),
    }
}

fn open_partition(
    dir: &Path,
    partition: u32,
    recovery: Recovery,
    report: &mut OpenReport,
) -> Result<Partition, LogError> {
    let pdir = dir.join(format!("p{partition:04}"));
    let read_only = recovery == Recovery::ReadOnly;
    // A partition with nothing on disk yet, as a reader sees it: one empty segment.
    let empty = |pdir: PathBuf, active| Partition {
        segments: vec![Segment {
            base: 0,
            path: segment_path(&pdir, 0),
            positions: Vec::new(),
            size: 0,
        }],
        dir: pdir,
        active,
        durable_end: 0,
        broken: None,
    };
    if !pdir.exists() {
        if read_only {
            return Ok(empty(pdir, None));
        }
        private::create_dir(&pdir).map_err(io(format!("creating {}", pdir.display())))?;
        sync_dir(dir)?;
    }
    let mut bases: Vec<Offset> = Vec::new();
    for entry in std::fs::read_dir(&pdir).map_err(io(format!("listing {}", pdir.display())))? {
        let entry = entry.map_err(io(format!("listing {}", pdir.display())))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some(base) = name
            .strip_suffix(".seg")
            .and_then(|b| b.parse::<Offset>().ok())
        {
            bases.push(base);
        }
    }
    bases.sort_unstable();
    if bases.is_empty() {
        if read_only {
            return Ok(empty(pdir, None));
        }
        let active = create_segment(&pdir, &segment_path(&pdir, 0))?;
        return Ok(empty(pdir, Some(active)));
    }

    let mut segments: Vec<Segment> = Vec::new();
    let count = bases.len();
    for (i, base) in bases.into_iter().enumerate() {
        let path = segment_path(&pdir, base);
        if let Some(previous) = segments.last()
            && previous.end() != base
        {
            return Err(LogError::Corrupt {
                path: path.display().to_string(),
                message: format!(
                    "the segment starts at offset {base} but the one before it ends at {}",
                    previous.end()
                ),
            });
        }
        let last = i + 1 == count;
        segments.push(scan(partition, base, path, last, recovery, report)?);
    }
    let active_path = &segments[segments.len() - 1].path;
    let active = if read_only {
        None
    } else {
        Some(
            File::options()
                .append(true)
                .read(true)
                .open(active_path)
                .map_err(io(format!("opening {}", active_path.display())))?,
        )
    };
    let durable_end = segments[segments.len() - 1].end();
    Ok(Partition {
        dir: pdir,
        segments,
        active,
        durable_end,
        broken: None,
    })
}

/// Reads a segment's records; cuts a torn or corrupt tail of the last segment when allowed.
fn scan(
    partition: u32,
    base: Offset,
    path: PathBuf,
    last: bool,
    recovery: Recovery,
    report: &mut OpenReport,
) -> Result<Segment, LogError> {
    let bytes = std::fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
    let mut positions = Vec::new();
    let mut at = 0;
    let problem = loop {
        match entry::decode(&bytes, at) {
            Decoded::Record { next, .. } => {
                positions.push(at as u64);
                at = next;
            }
            Decoded::End => break None,
            Decoded::Torn => break Some("a record cut short".to_owned()),
            Decoded::Corrupt(why) => break Some(why),
        }
    };
    // A reader leaves a torn tail where it is: it may be a record being written now.
    let problem = problem.filter(|_| !(last && recovery == Recovery::ReadOnly));
    if let Some(reason) = problem {
        if !last || recovery == Recovery::Strict {
            return Err(LogError::Corrupt {
                path: path.display().to_string(),
                message: format!(
                    "at byte {at} of {}: {reason}{}",
                    bytes.len(),
                    if last {
                        " (open with Recovery::TruncateTornTail to cut it)"
                    } else {
                        ""
                    }
                ),
            });
        }
        let file = File::options()
            .write(true)
            .open(&path)
            .map_err(io(format!("opening {}", path.display())))?;
        file.set_len(at as u64)
            .and_then(|()| file.sync_all())
            .map_err(io(format!("truncating {}", path.display())))?;
        let dropped = (bytes.len() - at) as u64;
        tracing::warn!(path = %path.display(), at, dropped, "recovery cut a torn tail: {reason}");
        report.truncated.push(Truncation {
            partition,
            path: path.clone(),
            at: at as u64,
            bytes: dropped,
            reason,
        });
    }
    Ok(Segment {
        base,
        path,
        positions,
        size: at as u64,
    })
}
