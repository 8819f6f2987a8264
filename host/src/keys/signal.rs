//! Signals from outside, delivered to a key's input and waking it when it waits for one.

use std::sync::Arc;

use super::{Front, Head, Keys, wake};
use crate::agent::SIGNAL_IDS_KEPT;
use crate::agent::{Delivered, SignalError, SignalIn};
use crate::text;

/// Whether `sequence` is the input asked for (any, when none was).
fn sequence_fits(sequence: u64, asked: Option<u64>) -> bool {
    asked.is_none_or(|asked| asked == sequence)
}

impl<F: Front> Keys<F> {
    /// Delivers `signal` to `key`'s input `sequence`, or without one to the key's first
    /// unfinished input: into the input's inbox, durably (once per client id), where a wait
    /// for its name takes it, now if the input waits for it, or when it reaches that wait.
    /// A finished input, one the key never had, or a name no action declares is refused,
    /// and the signal goes to no other input.
    pub async fn signal(
        &self,
        key: &F::Key,
        sequence_asked: Option<u64>,
        signal: &SignalIn,
    ) -> Result<Delivered, SignalError> {
        let sequence = sequence_asked;
        signal.check()?;
        let (target, one_at_a_time) = {
            let mut table = self.shared.lock();
            let state = table.keys.get(key);
            // Sent again, to the key: the input it went to the first time.
            let sent = (state.map(|state| &state.signals))
                .and_then(|signals| signals.iter().find(|(id, _)| *id == signal.id));
            if let Some(&(_, sequence)) = sent
                && sequence_fits(sequence, sequence_asked)
            {
                return Ok(Delivered {
                    sequence,
                    repeat: true,
                });
            }
            let queue = state.map(|state| &state.queue);
            let found = match sequence {
                None => queue.and_then(|queue| queue.front()),
                Some(n) => queue.and_then(|queue| queue.iter().find(|q| q.input.sequence == n)),
            };
            let target = match (found, sequence) {
                (Some(queued), _) => queued.clone(),
                (None, None) => {
                    return Err(SignalError::NoInput {
                        key: key.to_string(),
                        name: signal.name.clone(),
                    });
                }
                (None, Some(n)) if n >= 1 && state.is_some_and(|s| n < s.next_sequence) => {
                    return Err(finished(key, n, signal));
                }
                (None, Some(n)) => {
                    return Err(SignalError::NoSuchInput {
                        key: key.to_string(),
                        sequence: n,
                    });
                }
            };
            let lock = (table.keys.get_mut(key))
                .map(|state| Arc::clone(state.signal_lock.get_or_insert_with(Default::default)))
                .unwrap_or_default();
            (target, lock)
        };
        let sequence = target.input.sequence;
        let agent = self
            .shared
            .front
            .agent(key, &target)
            .await
            .map_err(|fault| SignalError::Host {
                key: key.to_string(),
                sequence,
                name: signal.name.clone(),
                message: fault.to_string(),
            })?;
        let delivered = {
            let _one_at_a_time = one_at_a_time.lock().await;
            // Sent again, to the key, before a restart: the input it went to then.
            let sent = agent.signal_sent(&target.input.key, &signal.id);
            if let Some(sent) = sent
                && sent != sequence
                && sequence_fits(sent, sequence_asked)
            {
                return Ok(Delivered {
                    sequence: sent,
                    repeat: true,
                });
            }
            agent.deliver(&target.input.key, sequence, signal).await?
        };
        {
            let mut table = self.shared.lock();
            if let Some(state) = table.keys.get_mut(key) {
                if state.signals.len() >= SIGNAL_IDS_KEPT {
                    state.signals.pop_front();
                }
                state.signals.push_back((signal.id.clone(), sequence));
            }
        }
        // (The input may have finished as the signal was recorded: whether a wait of it took
        // the signal, its outputs say; it is answered as delivered, and goes nowhere else.)
        // A repeat changed nothing: the first one woke the input.
        if !delivered.repeat {
            tracing::info!(key = %key, sequence, signal = %signal.name,
                id = %text::escaped(&signal.id), "signal delivered");
            wake(
                &self.shared,
                &self.spawner,
                key,
                sequence,
                Some(&signal.name),
            );
            // Still waiting (for other signals): its inbox is set aside with its states.
            let waits = (self.shared.lock().keys.get(key)).is_some_and(|state| {
                !state.working
                    && matches!(state.head, Head::Waiting { sequence: s, .. } if s == sequence)
            });
            if waits {
                agent.shelve(&target.input.key, sequence).await;
            }
        }
        Ok(delivered)
    }
}

fn finished(key: &impl std::fmt::Display, sequence: u64, signal: &SignalIn) -> SignalError {
    SignalError::Finished {
        key: key.to_string(),
        sequence,
        name: signal.name.clone(),
    }
}
