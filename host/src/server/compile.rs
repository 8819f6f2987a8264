//! The host's compile slots: component uploads of every tenant compile at most
//! `compile-slots` at a time, with at most `compile-queue` more waiting; an upload past that
//! is turned away (503 with `Retry-After`) rather than queued without end.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Semaphore, SemaphorePermit};

#[derive(Debug)]
pub struct CompileSlots {
    slots: Semaphore,
    size: usize,
    queue: usize,
    waiting: AtomicUsize,
}

/// Every slot is taken and the queue is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the server is compiling {slots} components and {queue} more wait: try again later \
     (compile-slots, compile-queue)"
)]
pub struct Busy {
    pub slots: usize,
    pub queue: usize,
}

/// One upload's place in the queue, given back however its wait ends (a client that
/// disconnects drops it).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl CompileSlots {
    pub fn new(slots: usize, queue: usize) -> Self {
        let size = slots.max(1);
        Self {
            slots: Semaphore::new(size),
            size,
            queue,
            waiting: AtomicUsize::new(0),
        }
    }

    /// A slot, once one is free; [`Busy`] at once when `compile-queue` uploads already wait.
    pub async fn take(&self) -> Result<SemaphorePermit<'_>, Busy> {
        let busy = Busy {
            slots: self.size,
            queue: self.queue,
        };
        if let Ok(permit) = self.slots.try_acquire() {
            return Ok(permit);
        }
        self.waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.queue).then_some(n + 1)
            })
            .map_err(|_| busy)?;
        let _waiting = Waiting(&self.waiting);
        // The semaphore is never closed.
        self.slots.acquire().await.map_err(|_| busy)
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt as _;

    use super::*;

    #[tokio::test]
    async fn past_the_slots_and_the_queue_an_upload_is_turned_away() {
        let slots = CompileSlots::new(1, 1);
        let first = slots.take().await.expect("a free slot");
        let second = slots.take();
        tokio::pin!(second);
        // The second waits in the queue; a third finds it full.
        assert!(second.as_mut().now_or_never().is_none());
        let third = slots.take().await.expect_err("the queue is full");
        assert_eq!(third, Busy { slots: 1, queue: 1 });
        drop(first);
        let _second = second.await.expect("the freed slot");
        // The queue is empty again: a waiter may join it.
        let fourth = slots.take();
        tokio::pin!(fourth);
        assert!(fourth.as_mut().now_or_never().is_none());
    }
}
