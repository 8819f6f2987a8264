//! How to reach NATS: its URLs, the credentials to present and the TLS to speak. Secrets
//! (a password, a token, an NKey seed) are never shown: not in `Debug`, not in an error, and
//! a URL is shown without the user and password it may hold.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::super::LogError;

/// Where NATS is and how to authenticate to it.
#[derive(Clone, Default)]
pub struct NatsConnect {
    /// One URL, or several separated by commas: the nodes of a cluster (the client also
    /// learns the others from the one it reaches).
    pub urls: String,
    pub auth: NatsAuth,
    pub tls: NatsTls,
}

/// The credentials presented to the server: at most one kind.
#[derive(Clone, Default)]
pub enum NatsAuth {
    #[default]
    None,
    UserPassword {
        user: String,
        password: String,
    },
    Token(String),
    /// A user NKey seed (`SU…`): the client signs the server's nonce with it.
    NKey(String),
    /// A `.creds` file: a user JWT and its NKey seed.
    CredsFile(PathBuf),
}

/// TLS to the server: trusted authorities, a client certificate, and whether TLS is
/// required (it is whenever any of the others is set, or the server asks for it).
#[derive(Clone, Debug, Default)]
pub struct NatsTls {
    /// PEM certificates of the authorities to trust, besides the system's.
    pub ca: Option<PathBuf>,
    /// The client's PEM certificate chain and its key, for servers that verify clients.
    pub client: Option<(PathBuf, PathBuf)>,
    pub require: bool,
}

impl NatsConnect {
    /// `urls`, without credentials or TLS options.
    pub fn new(urls: impl Into<String>) -> Self {
        Self {
            urls: urls.into(),
            ..Self::default()
        }
    }

    /// The URLs as they may be shown: any `user:password@` replaced by `***@`.
    pub fn shown(&self) -> String {
        self.urls
            .split(',')
            .map(|url| shown_url(url.trim()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Connects, failing at once with the cause when no URL answers; once connected, the
    /// client reconnects by itself.
    pub async fn connect(&self) -> Result<async_nats::Client, LogError> {
        let failed = |e: &dyn fmt::Display| LogError::Io {
            context: format!("cannot connect to NATS at {}", self.shown()),
            source: std::io::Error::other(e.to_string()),
        };
        let mut options = async_nats::ConnectOptions::new();
        options = match &self.auth {
            NatsAuth::None => options,
            NatsAuth::UserPassword { user, password } => {
                options.user_and_password(user.clone(), password.clone())
            }
            NatsAuth::Token(token) => options.token(token.clone()),
            NatsAuth::NKey(seed) => options.nkey(seed.clone()),
            NatsAuth::CredsFile(path) => async_nats::ConnectOptions::with_credentials_file(path)
                .await
                .map_err(|e| {
                    // Never the file's contents: only which file and why.
                    failed(&format!(
                        "the credentials file {}: {}",
                        path.display(),
                        e.kind()
                    ))
                })?,
        };
        if let Some(ca) = &self.tls.ca {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls.client {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        let require = self.tls.require || self.tls.ca.is_some() || self.tls.client.is_some();
        let addresses: Vec<&str> = self.urls.split(',').map(str::trim).collect();
        options
            .require_tls(require)
            .connection_timeout(Duration::from_secs(5))
            .connect(addresses)
            .await
            .map_err(|e| failed(&e))
    }
}

impl fmt::Debug for NatsConnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConnect")
            .field("urls", &self.shown())
            .field("auth", &self.auth)
            .field("tls", &self.tls)
            .finish()
    }
}

impl fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::UserPassword { user, .. } => write!(f, "UserPassword({user}, ***)"),
            Self::Token(_) => f.write_str("Token(***)"),
            Self::NKey(_) => f.write_str("NKey(***)"),
            Self::CredsFile(path) => write!(f, "CredsFile({})", path.display()),
        }
    }
}

/// `url` without its user and password.
fn shown_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let rest = match rest[..authority_end].rfind('@') {
        Some(at) => format!("***@{}", &rest[at + 1..]),
        None => rest.to_owned(),
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{rest}"),
        None => rest,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_shown_without_its_credentials_and_secrets_are_not_debugged() {
        let connect = NatsConnect {
            urls: "nats://ann:hunter2@10.0.0.1:4222, tls://tok@n2:4222,n3:4222".to_owned(),
            auth: NatsAuth::UserPassword {
                user: "ann".to_owned(),
                password: "hunter2".to_owned(),
            },
            tls: NatsTls::default(),
        };
        assert_eq!(
            connect.shown(),
            "nats://***@10.0.0.1:4222,tls://***@n2:4222,n3:4222"
        );
        let debugged = format!("{connect:?}");
        assert!(
            !debugged.contains("hunter2") && !debugged.contains("tok@"),
            "{debugged}"
        );
        for auth in [
            NatsAuth::Token("s3cret".to_owned()),
            NatsAuth::NKey("SUs3cret".to_owned()),
        ] {
            assert!(!format!("{auth:?}").contains("s3cret"));
        }
    }
}
