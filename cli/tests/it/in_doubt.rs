//! In-doubt calls (docs/SEMANTICS.md, "In-doubt calls"), against a payment service on
//! loopback.
//!
//! The service can lose its next answer: it does not answer before the function's timeout
//! (and the function makes no retry), after applying the charge or before. The run fails with the call's outcome unknown to
//! the host, as when the process dies while a call runs; the input is then processed again,
//! as recovery would, and the function's `in-doubt` policy decides what happens.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use rewind_host::agent::Agent;
use rewind_host::durable::{Answer, resolve};
use rewind_host::store::{ActionStateStore, CallOutcome, InMemoryStore, KeyScope};
use serde_json::{Value, json};

use crate::support::{agent_file, agent_toml, agent_with, first_output, input, sandbox};

#[derive(Default)]
pub(crate) struct Payments {
    /// Charges made, by idempotency key.
    pub(crate) charges: Mutex<BTreeMap<String, Value>>,
    pub(crate) posts: AtomicU64,
    asks: AtomicU64,
    /// The next answers to lose (never sent: the caller times out).
    lose: AtomicU64,
    /// Whether a charge whose answer is lost is made all the same.
    apply_when_losing: bool,
}

fn idempotency_key(headers: &HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

async fn charge(
    State(payments): State<Arc<Payments>>,
    headers: HeaderMap,
    body: String,
) -> (StatusCode, String) {
    payments.posts.fetch_add(1, Ordering::SeqCst);
    let lose = payments
        .lose
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if lose && !payments.apply_when_losing {
        std::future::pending::<()>().await;
    }
    let amount = serde_json::from_str::<Value>(&body).unwrap_or_default()["amount"].clone();
    let charge = payments
        .charges
        .lock()
        .expect("lock")
        .entry(idempotency_key(&headers))
        .or_insert_with(|| json!({ "charged": amount }))
        .clone();
    if lose {
        std::future::pending::<()>().await;
    }
    (StatusCode::OK, charge.to_string())
}

async fn status(State(payments): State<Arc<Payments>>, headers: HeaderMap) -> (StatusCode, String) {
    payments.asks.fetch_add(1, Ordering::SeqCst);
    match payments
        .charges
        .lock()
        .expect("lock")
        .get(&idempotency_key(&headers))
    {
        Some(charge) => (StatusCode::OK, charge.to_string()),
        None => (StatusCode::NOT_FOUND, String::new()),
    }
}

/// Starts the service; returns it and its base URL.
pub(crate) async fn payments(lose: u64, apply_when_losing: bool) -> (Arc<Payments>, String) {
    let payments = Arc::new(Payments {
        lose: AtomicU64::new(lose),
        apply_when_losing,
        ..Payments::default()
    });
    let app = Router::new()
        .route("/charge", post(charge))
        .route("/charge/status", get(status))
        .route(
            "/broken",
            get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "down") }),
        )
        .with_state(Arc::clone(&payments));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (payments, format!("http://{addr}"))
}

pub(crate) fn pay_agent(base: &str, policy: &str, reconcile_path: &str) -> String {
    agent_toml(
        "caller",
        "",
        &format!(
            "[functions.pay]\nkind = \"http\"\nurl = \"{base}/charge\"\nretries = 0\ntimeout-ms = 300\nin-doubt = \"{policy}\"\nreconcile-url = \"{base}{reconcile_path}\"\n"
        ),
    )
}

fn pay_input() -> rewind_host::event::Input {
    input(
        "ana",
        1,
        json!({ "calls": [{ "function": "pay", "args": { "amount": 5 } }] }),
    )
}

fn recorded(store: &InMemoryStore) -> Vec<CallOutcome> {
    store
        .states(&KeyScope::new("default", "test", "ana"))
        .into_iter()
        .flat_map(|s| s.calls)
        .map(|c| c.outcome)
        .collect()
}

/// The agent over a fresh store, and the first run, whose answer the service loses.
async fn first_run_loses_the_answer(toml: &str) -> (Agent, Arc<InMemoryStore>) {
    let store = Arc::new(InMemoryStore::default());
    let agent = agent_with(toml, store.clone(), &[]);
    let first = agent.process(&pay_input(), &Default::default()).await;
    let error = first.error.expect("the answer was lost").to_string();
    assert!(error.contains("timed out"), "{error}");
    (agent, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_records_what_the_remote_says_a_lost_call_did() {
    let (payments, base) = payments(1, true).await;
    let (agent, store) =
        first_run_loses_the_answer(&pay_agent(&base, "reconcile", "/charge/status")).await;
    assert_eq!(
        recorded(&store),
        [CallOutcome::Pending],
        "the pending record was durable before the call"
    );

    let again = agent.process(&pay_input(), &Default::default()).await;
    assert!(again.error.is_none(), "{:?}", again.error);
    assert_eq!(
        first_output(&again)["results"][0]["ok"],
        json!({ "charged": 5 })
    );
    assert_eq!(
        payments.posts.load(Ordering::SeqCst),
        1,
        "not charged again"
    );
    assert_eq!(payments.asks.load(Ordering::SeqCst), 1);
    assert_eq!(again.calls.reconciled, 1);
    assert_eq!(
        recorded(&store),
        [CallOutcome::Succeeded(json!({ "charged": 5 }).to_string())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_makes_the_call_when_the_remote_never_saw_it() {
    let (payments, base) = payments(1, false).await;
    let (agent, _store) =
        first_run_loses_the_answer(&pay_agent(&base, "reconcile", "/charge/status")).await;
    let again = agent.process(&pay_input(), &Default::default()).await;
    assert!(again.error.is_none(), "{:?}", again.error);
    assert_eq!(payments.asks.load(Ordering::SeqCst), 1);
    assert_eq!(
        payments.posts.load(Ordering::SeqCst),
        2,
        "asked, then called"
    );
    assert_eq!(payments.charges.lock().expect("lock").len(), 1);
    assert_eq!((again.calls.reconciled, again.calls.live), (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_that_cannot_ask_fails_the_run_and_keeps_the_call_pending() {
    let (payments, base) = payments(1, true).await;
    let (agent, store) =
        first_run_loses_the_answer(&pay_agent(&base, "reconcile", "/broken")).await;
    let again = agent.process(&pay_input(), &Default::default()).await;
    let error = again.error.expect("cannot reconcile").to_string();
    assert!(error.contains("reconciling a call in doubt"), "{error}");
    assert_eq!(recorded(&store), [CallOutcome::Pending]);
    assert_eq!(payments.posts.load(Ordering::SeqCst), 1, "not called again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_refuses_a_call_in_doubt_and_names_it() {
    let (payments, base) = payments(1, true).await;
    let (agent, store) =
        first_run_loses_the_answer(&pay_agent(&base, "fail", "/charge/status")).await;
    let key = store
        .states(&KeyScope::new("default", "test", "ana"))
        .into_iter()
        .flat_map(|s| s.calls)
        .map(|c| c.idempotency_key)
        .next()
        .expect("a pending record");
    for _ in 0..2 {
        let again = agent.process(&pay_input(), &Default::default()).await;
        let error = again.error.expect("in doubt").to_string();
        assert!(error.contains("call 0 to `pay`"), "{error}");
        assert!(error.contains(&key), "names the idempotency key: {error}");
        assert!(error.contains("in doubt"), "{error}");
    }
    assert_eq!(
        payments.posts.load(Ordering::SeqCst),
        1,
        "never called again"
    );
    assert_eq!(payments.asks.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_writes_nothing_before_the_call_and_calls_again_with_the_same_key() {
    let (payments, base) = payments(1, true).await;
    let (agent, store) =
        first_run_loses_the_answer(&pay_agent(&base, "retry", "/charge/status")).await;
    assert!(
        recorded(&store).is_empty(),
        "nothing written before the call"
    );
    let again = agent.process(&pay_input(), &Default::default()).await;
    assert!(again.error.is_none(), "{:?}", again.error);
    assert_eq!(payments.posts.load(Ordering::SeqCst), 2, "called again");
    assert_eq!(
        payments.charges.lock().expect("lock").len(),
        1,
        "with the same key, so the service charged once"
    );
    assert_eq!(payments.asks.load(Ordering::SeqCst), 0);
}

#[test]
fn reconcile_without_a_way_to_ask_is_refused_when_the_agent_loads() {
    let toml = agent_toml(
        "caller",
        "",
        "[functions.pay]\nkind = \"http\"\nurl = \"http://127.0.0.1:9/charge\"\nin-doubt = \"reconcile\"\n\n[functions.ledger]\nkind = \"custom\"\nin-doubt = \"reconcile\"\n",
    );
    let error = Agent::builder(agent_file(&toml), sandbox())
        .function("ledger", crate::support::Counting::new())
        .build()
        .expect_err("refused")
        .to_string();
    assert!(
        error.contains("`ledger`") || error.contains("`pay`"),
        "{error}"
    );
    assert!(error.contains("needs a reconcile handler"), "{error}");

    let toml = agent_toml(
        "caller",
        "",
        "[functions.pay]\nkind = \"http\"\nurl = \"http://127.0.0.1:9/charge\"\nin-doubt = \"reconcile\"\n",
    );
    let error = Agent::builder(agent_file(&toml), sandbox())
        .build()
        .expect_err("refused")
        .to_string();
    assert!(error.contains("set `reconcile-url`"), "{error}");

    let toml = agent_toml(
        "caller",
        "",
        "[functions.now]\nkind = \"time\"\nreconcile-url = \"http://127.0.0.1:9/\"\n",
    );
    let error = rewind_host::agent::AgentFile::parse(std::path::Path::new("agent.toml"), &toml)
        .expect_err("refused")
        .to_string();
    assert!(error.contains("`reconcile-url` does not apply"), "{error}");
}

/// A custom function that reconciles: it remembers what it did, by idempotency key.
#[derive(Debug, Default)]
struct Ledger {
    done: Mutex<BTreeMap<String, String>>,
    calls: AtomicU64,
    /// The next call does its work and then reports the remote unreachable.
    lose_next: AtomicU64,
}

#[async_trait::async_trait]
impl rewind_host::functions::Function for Ledger {
    async fn call(
        &self,
        request: rewind_host::functions::CallRequest<'_>,
    ) -> Result<String, rewind_host::functions::FunctionError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let args: Value = serde_json::from_str(request.args).unwrap_or_default();
        let result = json!({ "entry": args }).to_string();
        self.done
            .lock()
            .expect("lock")
            .insert(request.idempotency_key.to_owned(), result.clone());
        if self.lose_next.swap(0, Ordering::SeqCst) == 1 {
            return Err(rewind_host::functions::FunctionError::Unavailable(
                "the answer was lost".to_owned(),
            ));
        }
        Ok(result)
    }

    fn can_reconcile(&self) -> bool {
        true
    }

    async fn reconcile(
        &self,
        request: rewind_host::functions::CallRequest<'_>,
    ) -> Result<rewind_host::functions::Reconciled, rewind_host::functions::FunctionError> {
        Ok(
            match self.done.lock().expect("lock").get(request.idempotency_key) {
                Some(result) => rewind_host::functions::Reconciled::Succeeded(result.clone()),
                None => rewind_host::functions::Reconciled::NotRun,
            },
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_function_reconciles_through_its_own_handler() {
    let ledger = Arc::new(Ledger {
        lose_next: AtomicU64::new(1),
        ..Ledger::default()
    });
    let toml = agent_toml(
        "caller",
        "",
        "[functions.ledger]\nkind = \"custom\"\nin-doubt = \"reconcile\"\n",
    );
    let store = Arc::new(InMemoryStore::default());
    let agent = agent_with(&toml, store.clone(), &[("ledger", ledger.clone())]);
    let line = input(
        "ana",
        1,
        json!({ "calls": [{ "function": "ledger", "args": { "amount": 5 } }] }),
    );
    assert!(
        agent
            .process(&line, &Default::default())
            .await
            .error
            .is_some(),
        "the answer was lost"
    );
    let again = agent.process(&line, &Default::default()).await;
    assert!(again.error.is_none(), "{:?}", again.error);
    assert_eq!(ledger.calls.load(Ordering::SeqCst), 1, "not called again");
    assert_eq!(again.calls.reconciled, 1);
    assert_eq!(
        first_output(&again)["results"][0]["ok"],
        json!({ "entry": { "amount": 5 } })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_answer_for_a_call_in_doubt_is_served_and_the_call_never_made_again() {
    let (payments, base) = payments(1, true).await;
    let (agent, store) =
        first_run_loses_the_answer(&pay_agent(&base, "fail", "/charge/status")).await;
    let scope = KeyScope::new("default", "test", "ana");
    let error = resolve(&*store, &scope, 1, None, 3, &Answer::NotMade, "carol")
        .await
        .expect_err("call 3 was never made")
        .to_string();
    assert!(
        error.contains("has no call 3 in doubt (in doubt: `work` call 0)"),
        "{error}"
    );
    let error = resolve(
        &*store,
        &scope,
        1,
        None,
        0,
        &Answer::Result("{".to_owned()),
        "carol",
    )
    .await
    .expect_err("not JSON")
    .to_string();
    assert!(error.contains("the result is not JSON"), "{error}");

    let answer = Answer::Result(r#"{"charged": 5}"#.to_owned());
    let resolved = resolve(&*store, &scope, 1, None, 0, &answer, "carol")
        .await
        .expect("resolved");
    assert_eq!(
        (resolved.action.as_str(), resolved.function.as_str()),
        ("work", "pay")
    );
    let again = resolve(&*store, &scope, 1, None, 0, &answer, "carol").await;
    assert_eq!(again.expect("the same answer again").function, "pay");

    let report = agent.process(&pay_input(), &Default::default()).await;
    assert!(report.error.is_none(), "{:?}", report.error);
    assert!(
        first_output(&report).to_string().contains("charged"),
        "the answer is served: {:?}",
        report.outputs
    );
    assert_eq!(
        payments.posts.load(Ordering::SeqCst),
        1,
        "never called again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_doubt_answered_as_never_made_is_made_again_under_its_key() {
    let (payments, base) = payments(1, false).await;
    let (agent, store) =
        first_run_loses_the_answer(&pay_agent(&base, "fail", "/charge/status")).await;
    let scope = KeyScope::new("default", "test", "ana");
    let key = store
        .states(&scope)
        .into_iter()
        .flat_map(|s| s.calls)
        .map(|c| c.idempotency_key)
        .next()
        .expect("a pending record");
    let resolved = resolve(&*store, &scope, 1, None, 0, &Answer::NotMade, "carol")
        .await
        .expect("resolved");
    assert_eq!(resolved.idempotency_key, key);
    let report = agent.process(&pay_input(), &Default::default()).await;
    assert!(report.error.is_none(), "{:?}", report.error);
    assert_eq!(payments.posts.load(Ordering::SeqCst), 2, "made again");
    let charges: Vec<String> = payments
        .charges
        .lock()
        .expect("lock")
        .keys()
        .cloned()
        .collect();
    assert_eq!(charges, [key], "under the key it had");
}
