//! Per-tenant quotas: what one run may use, how much a tenant may run and call at once or
//! per minute, and how much it may store. Over a quota, a request gets 429 naming it.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::durable::CallBudget;
use crate::sandbox::Limits;

/// A tenant's quotas. `[quotas]` in rewind.toml sets them for every tenant;
/// `[tenants.NAME.quotas]` overrides any of them for one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Quotas {
    /// Linear memory one run may grow to, in MiB. Default 64.
    pub memory_mib: u32,
    /// CPU one run may use, in wasmtime fuel (about one per instruction). Default 2,000,000,000.
    pub fuel: u64,
    /// Wall-clock time one run may take, in milliseconds. Default 30,000.
    pub timeout_ms: u64,
    /// Action runs of the tenant at once; more wait for a slot. An agent whose
    /// `parallelism` asks for more is refused. Default 4.
    pub concurrent_runs: u32,
    /// Inputs accepted and not yet finished; a submission beyond is refused. Default 10,000.
    pub queued_inputs: u64,
    /// Live durable calls per minute (calls served from records are free). Default 600.
    pub calls_per_minute: u32,
    /// Bytes under the tenant's directory: components, agents, events, outputs, recorded
    /// calls. Default 1 GiB.
    pub stored_bytes: u64,
}

impl Default for Quotas {
    fn default() -> Self {
        let limits = Limits::default();
        Self {
            memory_mib: limits.memory_mib,
            fuel: limits.fuel,
            timeout_ms: limits.timeout_ms,
            concurrent_runs: 4,
            queued_inputs: 10_000,
            calls_per_minute: 600,
            stored_bytes: 1 << 30,
        }
    }
}

/// `[tenants.NAME.quotas]`: any of [`Quotas`], overriding `[quotas]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct QuotaOverrides {
    pub memory_mib: Option<u32>,
    pub fuel: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub concurrent_runs: Option<u32>,
    pub queued_inputs: Option<u64>,
    pub calls_per_minute: Option<u32>,
    pub stored_bytes: Option<u64>,
}

impl QuotaOverrides {
    pub fn apply(&self, base: Quotas) -> Quotas {
        Quotas {
            memory_mib: self.memory_mib.unwrap_or(base.memory_mib),
            fuel: self.fuel.unwrap_or(base.fuel),
            timeout_ms: self.timeout_ms.unwrap_or(base.timeout_ms),
            concurrent_runs: self.concurrent_runs.unwrap_or(base.concurrent_runs),
            queued_inputs: self.queued_inputs.unwrap_or(base.queued_inputs),
            calls_per_minute: self.calls_per_minute.unwrap_or(base.calls_per_minute),
            stored_bytes: self.stored_bytes.unwrap_or(base.stored_bytes),
        }
    }
}

/// A quota a request ran into: its name as in rewind.toml, and what it allows.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("over the tenant's quota `{quota}` ({allowed}): {detail}")]
pub struct QuotaExceeded {
    pub quota: &'static str,
    pub allowed: u64,
    pub detail: String,
}

/// Which of an agent's limits its agent.toml sets (the others are defaults).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitsGiven {
    pub memory_mib: bool,
    pub fuel: bool,
    pub timeout_ms: bool,
    pub parallelism: bool,
}

impl Quotas {
    /// Fits an agent's limits and parallelism into these quotas: a value its agent.toml
    /// sets above a quota is refused, naming the quota; a default above one is lowered to it.
    pub fn fit(
        &self,
        limits: &mut Limits,
        parallelism: &mut usize,
        given: LimitsGiven,
    ) -> Result<(), QuotaExceeded> {
        fn fit_one<T: Copy + PartialOrd + Into<u64>>(
            value: &mut T,
            quota: T,
            given: bool,
            name: &'static str,
            key: &str,
        ) -> Result<(), QuotaExceeded> {
            if *value <= quota {
                return Ok(());
            }
            if given {
                return Err(QuotaExceeded {
                    quota: name,
                    allowed: quota.into(),
                    detail: format!("agent.toml asks for {key} = {}", (*value).into()),
                });
            }
            *value = quota;
            Ok(())
        }
        fit_one(
            &mut limits.memory_mib,
            self.memory_mib,
            given.memory_mib,
            "memory-mib",
            "limits.memory-mib",
        )?;
        fit_one(
            &mut limits.fuel,
            self.fuel,
            given.fuel,
            "fuel",
            "limits.fuel",
        )?;
        fit_one(
            &mut limits.timeout_ms,
            self.timeout_ms,
            given.timeout_ms,
            "timeout-ms",
            "limits.timeout-ms",
        )?;
        let mut runs = u64::try_from(*parallelism).unwrap_or(u64::MAX);
        fit_one(
            &mut runs,
            self.concurrent_runs.into(),
            given.parallelism,
            "concurrent-runs",
            "parallelism",
        )?;
        *parallelism = usize::try_from(runs).unwrap_or(usize::MAX);
        Ok(())
    }
}

/// Live calls per minute: a sliding window of the last minute's calls.
#[derive(Debug)]
pub struct CallsPerMinute {
    limit: u32,
    window: Duration,
    taken: Mutex<VecDeque<Instant>>,
}

impl CallsPerMinute {
    pub fn new(limit: u32) -> Self {
        Self {
            limit,
            window: Duration::from_secs(60),
            taken: Mutex::new(VecDeque::new()),
        }
    }

    /// Calls left in the window now.
    pub fn left(&self) -> u32 {
        let mut taken = self.lock();
        self.expire(&mut taken);
        self.limit
            .saturating_sub(u32::try_from(taken.len()).unwrap_or(u32::MAX))
    }

    /// Refuses when the window is spent (a submission would only wait for it).
    pub fn check(&self) -> Result<(), QuotaExceeded> {
        if self.left() > 0 {
            return Ok(());
        }
        Err(self.exceeded())
    }

    fn exceeded(&self) -> QuotaExceeded {
        QuotaExceeded {
            quota: "calls-per-minute",
            allowed: self.limit.into(),
            detail: format!("{} live calls in the last minute", self.limit),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Instant>> {
        self.taken.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn expire(&self, taken: &mut VecDeque<Instant>) {
        let now = Instant::now();
        while taken
            .front()
            .is_some_and(|&at| now.duration_since(at) >= self.window)
        {
            taken.pop_front();
        }
    }
}

impl CallBudget for CallsPerMinute {
    fn take(&self) -> Result<(), String> {
        let mut taken = self.lock();
        self.expire(&mut taken);
        if taken.len() >= self.limit as usize {
            return Err(self.exceeded().to_string());
        }
        taken.push_back(Instant::now());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_limit_over_a_quota_is_refused_and_a_default_lowered() {
        let quotas = Quotas {
            memory_mib: 16,
            concurrent_runs: 2,
            ..Quotas::default()
        };
        let mut limits = Limits::default();
        let mut parallelism = 8;
        quotas
            .fit(&mut limits, &mut parallelism, LimitsGiven::default())
            .expect("defaults fit");
        assert_eq!((limits.memory_mib, parallelism), (16, 2));

        let mut limits = Limits {
            memory_mib: 32,
            ..Limits::default()
        };
        let given = LimitsGiven {
            memory_mib: true,
            ..LimitsGiven::default()
        };
        let error = quotas
            .fit(&mut limits, &mut parallelism, given)
            .expect_err("over");
        assert_eq!(error.quota, "memory-mib");
        assert!(
            error.to_string().contains("limits.memory-mib = 32"),
            "{error}"
        );
    }

    #[test]
    fn the_call_budget_is_spent_then_denies() {
        let budget = CallsPerMinute::new(2);
        assert!(budget.take().is_ok() && budget.take().is_ok());
        let denied = budget.take().expect_err("spent");
        assert!(denied.contains("calls-per-minute"), "{denied}");
        assert_eq!(budget.check().expect_err("spent").quota, "calls-per-minute");
    }
}
