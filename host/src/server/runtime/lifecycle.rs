//! What the server's tenants share as it runs and stops: whether it is stopping, how many
//! inputs run, and whether output streams should end.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};

/// What the server's tenants share: whether it is stopping, and how many inputs run.
#[derive(Debug)]
pub struct Lifecycle {
    stopping: AtomicBool,
    running: AtomicUsize,
    idle: Notify,
    /// True once the server stops accepting requests: streams end.
    closing: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            stopping: AtomicBool::new(false),
            running: AtomicUsize::new(0),
            idle: Notify::new(),
            closing: watch::channel(false).0,
        }
    }
}

impl Lifecycle {
    /// Ends every output stream (so that the HTTP server can finish its connections).
    pub fn close_streams(&self) {
        self.closing.send_replace(true);
    }

    pub fn closing(&self) -> watch::Receiver<bool> {
        self.closing.subscribe()
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// No input starts from now on; waits up to `grace` for those running to finish.
    /// Returns how many were still running (they resume at the next start).
    pub async fn stop(&self, grace: Duration) -> usize {
        self.stopping.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let idle = self.idle.notified();
            let running = self.running.load(Ordering::SeqCst);
            if running == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.running.load(Ordering::SeqCst);
            }
        }
    }

    pub(super) fn started(&self) {
        self.running.fetch_add(1, Ordering::SeqCst);
    }

    pub(super) fn finished(&self) {
        if self.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }
}
