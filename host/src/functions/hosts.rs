//! The hosts a tenant's functions may reach, set by the operator (`allow-hosts` in
//! rewind.toml). Checked when an agent is defined, and again on every redirect.

use std::fmt;

/// An allow-list of hosts: `name` allows any port, `name:port` one port.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AllowedHosts {
    entries: Vec<(String, Option<u16>)>,
}

impl AllowedHosts {
    /// Parses `entries`; names the first one that is not a host or `host:port`.
    pub fn new<S: AsRef<str>>(entries: &[S]) -> Result<Self, String> {
        let mut parsed = Vec::with_capacity(entries.len());
        for entry in entries {
            let entry = entry.as_ref();
            let url = reqwest::Url::parse(&format!("http://{entry}/"))
                .ok()
                .filter(|url| url.path() == "/" && url.username().is_empty())
                .ok_or_else(|| format!("`{entry}` is not a host or host:port"))?;
            let host = url.host_str().unwrap_or_default().to_ascii_lowercase();
            // `Url` drops port 80 for http; an entry that names it means that port.
            let port = url.port().or_else(|| entry.ends_with(":80").then_some(80));
            parsed.push((host, port));
        }
        Ok(Self { entries: parsed })
    }

    /// Whether `url` is on an allowed host (and port).
    pub fn allows(&self, url: &reqwest::Url) -> bool {
        let Some(host) = url.host_str() else {
            return false;
        };
        let host = host.to_ascii_lowercase();
        let port = url.port_or_known_default();
        self.entries
            .iter()
            .any(|(allowed, p)| *allowed == host && p.is_none_or(|p| Some(p) == port))
    }

    /// Why `url` may not be reached, if it may not.
    pub fn check(&self, url: &str) -> Result<(), String> {
        let parsed = reqwest::Url::parse(url).map_err(|e| format!("`{url}` is not a URL: {e}"))?;
        if self.allows(&parsed) {
            return Ok(());
        }
        let authority = match (parsed.host_str(), parsed.port_or_known_default()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (Some(host), None) => host.to_owned(),
            _ => url.to_owned(),
        };
        Err(format!(
            "{authority} is not on this tenant's allow-list ({self}); the operator sets it \
             with `allow-hosts` in rewind.toml"
        ))
    }
}

impl fmt::Display for AllowedHosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.entries.is_empty() {
            return f.write_str("empty");
        }
        for (i, (host, port)) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match port {
                Some(port) => write!(f, "{host}:{port}")?,
                None => f.write_str(host)?,
            }
        }
        Ok(())
    }
}

impl fmt::Debug for AllowedHosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AllowedHosts({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> reqwest::Url {
        reqwest::Url::parse(text).expect("a URL")
    }

    #[test]
    fn a_host_allows_every_port_and_host_port_one() {
        let hosts = AllowedHosts::new(&["api.example.com", "127.0.0.1:8080", "LOCALHOST:80"])
            .expect("valid");
        assert!(hosts.allows(&url("https://api.example.com/v1")));
        assert!(hosts.allows(&url("http://api.example.com:9999/")));
        assert!(hosts.allows(&url("http://127.0.0.1:8080/x")));
        assert!(!hosts.allows(&url("http://127.0.0.1:8081/x")));
        assert!(hosts.allows(&url("http://localhost/")));
        assert!(!hosts.allows(&url("https://localhost/")));
        assert!(!hosts.allows(&url("https://evil.example.com/")));
        let error = hosts.check("http://10.0.0.1:9/").expect_err("not allowed");
        assert!(error.contains("10.0.0.1:9"), "{error}");
    }

    #[test]
    fn a_bad_entry_is_named() {
        let error = AllowedHosts::new(&["http://x/y"]).expect_err("a URL, not a host");
        assert!(error.contains("http://x/y"), "{error}");
    }
}
