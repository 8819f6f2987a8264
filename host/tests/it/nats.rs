//! The log on NATS JetStream (issue #7): the conformance suite every log passes, against a
//! real nats-server (Debian's, installed by scripts/test.sh) on loopback.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rewind_host::log::{Guarded, JetStreamLog, Log};

/// A nats-server with JetStream on a free loopback port, killed when dropped.
#[derive(Debug)]
struct NatsServer {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl NatsServer {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let config: PathBuf = dir.path().join("nats.conf");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nmax_payload: 8MB\njetstream {{ store_dir: {:?} }}\n",
                dir.path().join("js")
            ),
        )
        .expect("config");
        // Debian puts it in /usr/sbin, which is not on every user's PATH.
        let program = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .unwrap_or("nats-server");
        let child = Command::new(program)
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server runs (scripts/test.sh installs it)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            _dir: dir,
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn jetstream_log(partitions: u32) -> Arc<dyn Log> {
    let server = NatsServer::start();
    let log = tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current().block_on(JetStreamLog::connect(
            &server.url,
            "rewind-test",
            partitions,
            1,
        ))
    })
    .expect("the log connects");
    Arc::new(Guarded::new(log, server))
}

rewind_host::log_conformance_tests!(jetstream_log);

/// The store's conformance suite over the JetStream log, with either marker strategy.
mod store {
    use std::sync::Arc;

    use rewind_host::store::{LogStore, MarkerStrategy};

    mod offsets {
        use super::*;
        rewind_host::store_conformance_tests!(|partitions| Arc::new(LogStore::new(
            super::super::jetstream_log(partitions),
            MarkerStrategy::Offsets
        )));
    }

    mod refresh {
        use super::*;
        rewind_host::store_conformance_tests!(|partitions| Arc::new(LogStore::new(
            super::super::jetstream_log(partitions),
            MarkerStrategy::Refresh
        )));
    }
}
