//! Per-tenant quotas: what one run may use, how much a tenant may run and call at once or
//! per minute, and how much it may store. Over a quota, a request gets 429 naming it.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::agent::AgentConfig;
use crate::durable::CallBudget;
use crate::functions::DEFAULT_MAX_RESPONSE_BYTES;
use crate::sandbox::Limits;

/// A tenant's quotas. `[quotas]` in rewind.toml sets them for every tenant;
/// `[tenants.NAME.quotas]` overrides any of them for one.
///
/// The first group caps what an agent's `[limits]` (and its functions'
/// `max-response-bytes`) may ask for, each under the same name; the second bounds the
/// tenant as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Quotas {
    /// Linear memory one run may grow to, in MiB. Default 64.
    pub memory_mib: u32,
    /// CPU one run may use, in wasmtime fuel (about one per instruction). Default 2,000,000,000.
    pub fuel: u64,
    /// Wall-clock time one run may take, in milliseconds. Default 30,000.
    pub timeout_ms: u64,
    /// Durable calls one run may make. Default 64.
    pub calls_per_run: u32,
    /// Clock readings one run may take. Default 10,000.
    pub clock_readings_per_run: u32,
    /// Bytes one run may write to memory. Default 4 MiB.
    pub memory_set_bytes: u64,
    /// Bytes of a key's memory after a run. Default 16 MiB.
    pub memory_bytes: u64,
    /// Memory writes one run may make. Default 1,000.
    pub memory_set_entries: u32,
    /// Bytes of one memory name. Default 256.
    pub memory_name_bytes: u32,
    /// Bytes of one sent event. Default 1 MiB.
    pub send_payload_bytes: u64,
    /// Bytes one run may send. Default 4 MiB.
    pub send_bytes: u64,
    /// Events one run may send. Default 1,024.
    pub sends_per_run: u32,
    /// Bytes of log one run may write. Default 256 KiB.
    pub log_bytes: u64,
    /// Bytes of a function's answer read. Default 4 MiB.
    pub max_response_bytes: u64,
    /// Action runs of the tenant at once; more wait for a slot. An agent whose
    /// `parallelism` asks for more is refused. Default 4.
    pub concurrent_runs: u32,
    /// Inputs accepted and not yet finished; a submission beyond is refused. Default 10,000.
    pub queued_inputs: u64,
    /// Live durable calls per minute (calls served from records are free). Default 600.
    pub calls_per_minute: u32,
    /// Component uploads per minute: each is compiled and checked. Default 30.
    pub compiles_per_minute: u32,
    /// Signals sent per minute, over all the tenant's keys (each rewrites an input's
    /// inbox, and may wake a run). Default 600.
    pub signals_per_minute: u32,
    /// Functions one agent may define. Default 32.
    pub functions_per_agent: u32,
    /// Versions of one agent kept loaded: older ones are let go, and loaded again only
    /// when an input of theirs runs. Default 8.
    pub agent_versions_loaded: u32,
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
            calls_per_run: limits.calls_per_run,
            clock_readings_per_run: limits.clock_readings_per_run,
            memory_set_bytes: limits.memory_set_bytes,
            memory_bytes: limits.memory_bytes,
            memory_set_entries: limits.memory_set_entries,
            memory_name_bytes: limits.memory_name_bytes,
            send_payload_bytes: limits.send_payload_bytes,
            send_bytes: limits.send_bytes,
            sends_per_run: limits.sends_per_run,
            log_bytes: limits.log_bytes,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES as u64,
            concurrent_runs: 4,
            queued_inputs: 10_000,
            calls_per_minute: 600,
            compiles_per_minute: 30,
            signals_per_minute: 600,
            functions_per_agent: 32,
            agent_versions_loaded: 8,
            stored_bytes: 1 << 30,
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

/// Fits one value into its quota: a value its agent.toml `given` above the quota is
/// refused, naming the quota and the key; one not given (a default) is lowered to it.
fn fit_one<T: Copy + PartialOrd + Into<u64> + TryFrom<u64>>(
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

impl Quotas {
    /// Fits an agent's limits, its functions (how many, and their `max-response-bytes`)
    /// and its parallelism into these quotas. `given` says whether agent.toml sets a key, by its path (`["limits",
    /// "fuel"]`, `["functions", NAME, "max-response-bytes"]`, `["parallelism"]`): a value it
    /// sets above a quota is refused, naming the quota; a default above one is lowered to it.
    pub fn fit(
        &self,
        config: &mut AgentConfig,
        given: &dyn Fn(&[&str]) -> bool,
    ) -> Result<(), QuotaExceeded> {
        let limits = &mut config.limits;
        macro_rules! fit_limits {
            ($($field:ident: $name:literal),* $(,)?) => {
                $(fit_one(
                    &mut limits.$field,
                    self.$field,
                    given(&["limits", $name]),
                    $name,
                    concat!("limits.", $name),
                )?;)*
            };
        }
        fit_limits!(
            memory_mib: "memory-mib",
            fuel: "fuel",
            timeout_ms: "timeout-ms",
            calls_per_run: "calls-per-run",
            clock_readings_per_run: "clock-readings-per-run",
            memory_set_bytes: "memory-set-bytes",
            memory_bytes: "memory-bytes",
            memory_set_entries: "memory-set-entries",
            memory_name_bytes: "memory-name-bytes",
            send_payload_bytes: "send-payload-bytes",
            send_bytes: "send-bytes",
            sends_per_run: "sends-per-run",
            log_bytes: "log-bytes",
        );
        let functions = u32::try_from(config.functions.len()).unwrap_or(u32::MAX);
        if functions > self.functions_per_agent {
            return Err(QuotaExceeded {
                quota: "functions-per-agent",
                allowed: self.functions_per_agent.into(),
                detail: format!("agent.toml defines {functions} functions"),
            });
        }
        for (name, function) in &mut config.functions {
            let key = format!("functions.{name}.max-response-bytes");
            let mut bytes = function
                .max_response_bytes
                .unwrap_or(DEFAULT_MAX_RESPONSE_BYTES as u64);
            fit_one(
                &mut bytes,
                self.max_response_bytes,
                given(&["functions", name, "max-response-bytes"]),
                "max-response-bytes",
                &key,
            )?;
            function.max_response_bytes = Some(bytes);
        }
        let mut runs = u64::try_from(config.parallelism).unwrap_or(u64::MAX);
        fit_one(
            &mut runs,
            self.concurrent_runs.into(),
            given(&["parallelism"]),
            "concurrent-runs",
            "parallelism",
        )?;
        config.parallelism = usize::try_from(runs).unwrap_or(usize::MAX);
        Ok(())
    }
}

/// A per-minute quota (live calls, compiles): a sliding window of the last minute's takes.
#[derive(Debug)]
pub struct PerMinute {
    quota: &'static str,
    /// What is counted, plural (`live calls`).
    what: &'static str,
    limit: u32,
    window: Duration,
    taken: Mutex<VecDeque<Instant>>,
}

impl PerMinute {
    /// Live durable calls: `calls-per-minute`.
    pub fn calls(limit: u32) -> Self {
        Self::new("calls-per-minute", "live calls", limit)
    }

    /// Component compiles: `compiles-per-minute`.
    pub fn compiles(limit: u32) -> Self {
        Self::new("compiles-per-minute", "components compiled", limit)
    }

    /// Signals sent: `signals-per-minute`.
    pub fn signals(limit: u32) -> Self {
        Self::new("signals-per-minute", "signals sent", limit)
    }

    fn new(quota: &'static str, what: &'static str, limit: u32) -> Self {
        Self {
            quota,
            what,
            limit,
            window: Duration::from_secs(60),
            taken: Mutex::new(VecDeque::new()),
        }
    }

    /// Takes left in the window now.
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

    /// Takes one, or refuses when the window is spent.
    pub fn take_one(&self) -> Result<(), QuotaExceeded> {
        let mut taken = self.lock();
        self.expire(&mut taken);
        if taken.len() >= self.limit as usize {
            return Err(self.exceeded());
        }
        taken.push_back(Instant::now());
        Ok(())
    }

    fn exceeded(&self) -> QuotaExceeded {
        QuotaExceeded {
            quota: self.quota,
            allowed: self.limit.into(),
            detail: format!("{} {} in the last minute", self.limit, self.what),
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

impl CallBudget for PerMinute {
    fn take(&self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(self.take_one()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(extra: &str) -> AgentConfig {
        let text = format!(
            "name = \"a\"\n{extra}\n[[actions]]\nname = \"w\"\ncomponent = \"w.wasm\"\non = [\"input\"]\n\
             [functions.f]\nkind = \"http\"\nurl = \"http://localhost/\"\n"
        );
        crate::agent::AgentFile::parse(std::path::Path::new("agent.toml"), &text)
            .expect("an agent")
            .config
    }

    #[test]
    fn a_given_limit_over_a_quota_is_refused_and_a_default_lowered() {
        let quotas = Quotas {
            memory_mib: 16,
            send_bytes: 1000,
            max_response_bytes: 2000,
            concurrent_runs: 2,
            ..Quotas::default()
        };
        let mut config = agent("");
        quotas.fit(&mut config, &|_| false).expect("defaults fit");
        assert_eq!(
            (
                config.limits.memory_mib,
                config.limits.send_bytes,
                config.functions["f"].max_response_bytes,
                config.parallelism
            ),
            (16, 1000, Some(2000), 2)
        );

        for (extra, key, quota) in [
            (
                "[limits]\nmemory-mib = 32",
                "limits.memory-mib = 32",
                "memory-mib",
            ),
            (
                "[limits]\nsend-bytes = 1001",
                "limits.send-bytes = 1001",
                "send-bytes",
            ),
        ] {
            let mut config = agent(extra);
            let error = quotas
                .fit(&mut config, &|path| {
                    path[0] == "limits" && extra.contains(&format!("{} =", path[1]))
                })
                .expect_err("over");
            assert_eq!(error.quota, quota);
            assert!(error.to_string().contains(key), "{error}");
        }
        let mut config = agent("");
        config.functions.get_mut("f").expect("f").max_response_bytes = Some(4096);
        let error = quotas
            .fit(&mut config, &|path| {
                path == ["functions", "f", "max-response-bytes"]
            })
            .expect_err("over");
        assert!(
            error
                .to_string()
                .contains("functions.f.max-response-bytes = 4096"),
            "{error}"
        );
    }

    /// Every run limit an agent.toml may set has a quota of the same name, and `fit` holds
    /// the agent to it: a limit added to `Limits` and forgotten here fails this test.
    #[test]
    fn every_run_limit_has_a_quota_of_its_name_that_fit_holds_the_agent_to() {
        let limits = serde_json::to_value(Limits::default()).expect("limits as JSON");
        let names: Vec<&String> = limits.as_object().expect("an object").keys().collect();
        assert!(names.len() >= 13, "{names:?}");
        for name in names {
            let mut quotas = serde_json::to_value(Quotas::default()).expect("quotas as JSON");
            let quota = quotas
                .get_mut(name)
                .unwrap_or_else(|| panic!("no quota `{name}`"));
            *quota = serde_json::json!(1);
            let quotas: Quotas = serde_json::from_value(quotas).expect("quotas");
            let mut config = agent(&format!("[limits]\n{name} = 2"));
            let error = quotas
                .fit(&mut config, &|path| path == ["limits", name.as_str()])
                .expect_err("over its quota");
            assert_eq!(error.quota, name, "{error}");
            assert!(
                error.to_string().contains(&format!("limits.{name} = 2")),
                "{error}"
            );
        }
    }

    #[test]
    fn an_agent_with_more_functions_than_its_quota_is_refused() {
        let quotas = Quotas {
            functions_per_agent: 0,
            ..Quotas::default()
        };
        let error = quotas
            .fit(&mut agent(""), &|_| false)
            .expect_err("one function, none allowed");
        assert_eq!(error.quota, "functions-per-agent");
        assert!(error.to_string().contains("defines 1 functions"), "{error}");
    }

    #[test]
    fn the_call_budget_is_spent_then_denies() {
        let budget = PerMinute::calls(2);
        assert!(budget.take().is_ok() && budget.take().is_ok());
        let denied = budget.take().expect_err("spent");
        let quota = denied
            .downcast_ref::<QuotaExceeded>()
            .expect("the quota it ran into");
        assert_eq!(quota.quota, "calls-per-minute", "{denied}");
        assert_eq!(budget.check().expect_err("spent").quota, "calls-per-minute");
    }
}
