//! One partition on disk: its segment files, the one being appended to, and what is durable.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use super::entry::{self, Decoded};
use crate::crash::{self, CrashPoint};
use crate::log::{LogError, Offset, Record};

/// One segment file: records from `base` on, at byte `positions[i]` for offset `base + i`.
#[derive(Debug)]
pub(super) struct Segment {
    pub base: Offset,
    pub path: PathBuf,
    pub positions: Vec<u64>,
    /// Bytes in the file that belong to whole records.
    pub size: u64,
}

impl Segment {
    pub fn end(&self) -> Offset {
        self.base + self.positions.len() as u64
    }
}

pub(super) fn segment_path(dir: &Path, base: Offset) -> PathBuf {
    dir.join(format!("{base:020}.seg"))
}

/// A partition's files and bookkeeping. Readers see only records below `durable_end`.
#[derive(Debug)]
pub(super) struct Partition {
    pub dir: PathBuf,
    /// Oldest first; never empty. The last one is being appended to.
    pub segments: Vec<Segment>,
    /// The last segment, open to append; `None` in a log opened to read only.
    pub active: Option<File>,
    /// Offsets below this are synced to disk.
    pub durable_end: Offset,
    /// Set when a write or sync failed in a way that leaves the file's state unknown.
    pub broken: Option<String>,
}

impl Partition {
    /// The file appends go to; an error in a log opened to read only.
    fn active_file(&mut self) -> Result<&mut File, LogError> {
        let dir = &self.dir;
        self.active.as_mut().ok_or_else(|| LogError::ReadOnly {
            path: dir.display().to_string(),
        })
    }

    pub fn start(&self) -> Offset {
        self.segments.first().map_or(0, |s| s.base)
    }

    /// The offset the next record written gets.
    pub fn next_offset(&self) -> Offset {
        self.segments.last().map_or(0, Segment::end)
    }

    fn active_segment(&mut self) -> &mut Segment {
        let last = self.segments.len() - 1;
        &mut self.segments[last]
    }

    /// Writes one framed record to the active segment (rolling it first when full) and
    /// returns its offset. Not durable until [`sync`](Self::sync).
    pub fn write(&mut self, frame: &[u8], segment_bytes: u64) -> Result<Offset, LogError> {
        if let Some(why) = &self.broken {
            return Err(LogError::Io {
                context: format!(
                    "{}: the partition stopped after an error",
                    self.dir.display()
                ),
                source: std::io::Error::other(why.clone()),
            });
        }
        let frame_len = frame.len() as u64;
        if self.active_segment().size > 0 && self.active_segment().size + frame_len > segment_bytes
        {
            self.roll()?;
        }
        let position = self.active_segment().size;
        let active = self.active_file()?;
        crash::reached_then(CrashPoint::TornWrite, || {
            let _ = active.write_all(&frame[..frame.len() / 2]);
            let _ = active.sync_data();
        });
        if let Err(source) = active.write_all(frame) {
            // Cut what part of the frame reached the file, so that the next record starts at
            // a record boundary; if even that fails, stop taking writes.
            if let Err(e) = active.set_len(position) {
                self.broken = Some(format!("could not cut a failed write: {e}"));
            }
            return Err(LogError::Io {
                context: format!("appending to {}", self.active_segment().path.display()),
                source,
            });
        }
        let offset = self.next_offset();
        let segment = self.active_segment();
        segment.positions.push(position);
        segment.size += frame_len;
        Ok(offset)
    }

    /// Makes everything written so far durable.
    pub fn sync(&mut self) -> Result<(), LogError> {
        match self.active_file()?.sync_data() {
            Ok(()) => {
                self.durable_end = self.next_offset();
                Ok(())
            }
            Err(source) => {
                // After a failed fsync the kernel may have dropped the dirty pages: nothing
                // about the file can be trusted until it is opened (and recovered) again.
                self.broken = Some(format!("fsync failed: {source}"));
                Err(LogError::Io {
                    context: format!("syncing {}", self.active_segment().path.display()),
                    source,
                })
            }
        }
    }

    /// Counts everything written so far as durable: the commit journal holds it.
    pub fn journaled(&mut self) {
        self.durable_end = self.next_offset();
    }

    /// Starts a new segment at the next offset.
    fn roll(&mut self) -> Result<(), LogError> {
        // Records written to the old segment must be durable before it stops being synced.
        self.sync()?;
        let base = self.next_offset();
        let path = segment_path(&self.dir, base);
        let file = create_segment(&self.dir, &path)?;
        self.segments.push(Segment {
            base,
            path,
            positions: Vec::new(),
            size: 0,
        });
        self.active = Some(file);
        Ok(())
    }

    /// Deletes the segments whose records are all below `offset`; never the active one.
    pub fn delete_below(&mut self, offset: Offset) -> Result<(), LogError> {
        let mut deleted = false;
        while self.segments.len() > 1 && self.segments[1].base <= offset {
            let segment = self.segments.remove(0);
            std::fs::remove_file(&segment.path).map_err(|source| LogError::Io {
                context: format!("deleting {}", segment.path.display()),
                source,
            })?;
            deleted = true;
        }
        if deleted {
            sync_dir(&self.dir)?;
        }
        Ok(())
    }

    /// What to read for `read(from, max)`, taken under the lock and executed without it.
    pub fn plan_read(
        &self,
        partition: u32,
        from: Offset,
        max: usize,
    ) -> Result<ReadPlan, LogError> {
        let (start, end) = (self.start(), self.durable_end);
        if from < start || from > end {
            return Err(LogError::OutOfRange {
                partition,
                offset: from,
                start,
                end,
            });
        }
        let last = end.min(from.saturating_add(max as u64));
        let mut pieces = Vec::new();
        for segment in &self.segments {
            let lo = from.max(segment.base);
            let hi = last.min(segment.end());
            if lo >= hi {
                continue;
            }
            let index =
                |offset: Offset| usize::try_from(offset - segment.base).unwrap_or(usize::MAX);
            let first_byte = segment.positions[index(lo)];
            let end_byte = segment
                .positions
                .get(index(hi))
                .copied()
                .unwrap_or(segment.size);
            pieces.push(ReadPiece {
                path: segment.path.clone(),
                first_offset: lo,
                count: index(hi) - index(lo),
                first_byte,
                end_byte,
            });
        }
        Ok(ReadPlan { pieces })
    }
}

#[derive(Debug)]
struct ReadPiece {
    path: PathBuf,
    first_offset: Offset,
    count: usize,
    first_byte: u64,
    end_byte: u64,
}

/// Records to read from segment files, planned under the partition's lock.
#[derive(Debug)]
pub(super) struct ReadPlan {
    pieces: Vec<ReadPiece>,
}

impl ReadPlan {
    /// Reads and checks the planned records.
    pub fn execute(self) -> Result<Vec<Record>, LogError> {
        let mut records = Vec::new();
        for piece in self.pieces {
            let io = |source| LogError::Io {
                context: format!("reading {}", piece.path.display()),
                source,
            };
            let file = File::open(&piece.path).map_err(io)?;
            let len = usize::try_from(piece.end_byte - piece.first_byte).unwrap_or(usize::MAX);
            let mut bytes = vec![0u8; len];
            file.read_exact_at(&mut bytes, piece.first_byte)
                .map_err(io)?;
            let mut at = 0;
            for i in 0..piece.count {
                match entry::decode(&bytes, at) {
                    Decoded::Record { payload, next } => {
                        records.push(Record {
                            offset: piece.first_offset + i as u64,
                            payload: bytes[payload].to_vec(),
                        });
                        at = next;
                    }
                    other => {
                        return Err(LogError::Corrupt {
                            path: piece.path.display().to_string(),
                            message: format!(
                                "offset {}: expected a record, found {other:?}",
                                piece.first_offset + i as u64
                            ),
                        });
                    }
                }
            }
        }
        Ok(records)
    }
}

/// Creates a new, empty segment file and makes its name durable.
pub(super) fn create_segment(dir: &Path, path: &Path) -> Result<File, LogError> {
    let file = File::options()
        .create_new(true)
        .mode(0o600)
        .append(true)
        .read(true)
        .open(path)
        .map_err(|source| LogError::Io {
            context: format!("creating {}", path.display()),
            source,
        })?;
    sync_dir(dir)?;
    Ok(file)
}

/// Makes the directory's entries (created, renamed or deleted files) durable.
pub(super) fn sync_dir(dir: &Path) -> Result<(), LogError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| LogError::Io {
            context: format!("syncing directory {}", dir.display()),
            source,
        })
}
