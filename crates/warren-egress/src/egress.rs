//! One VM's egress: the shared state ([`Inner`]) and the public handle that starts the proxy
//! and resolver tasks on the caller's tokio runtime.
//!
//! Ownership: [`Egress`] owns an `Arc<Inner>`; every task holds a clone. [`EgressHandle`]
//! aborts all tasks when dropped (or on [`EgressHandle::shutdown`]); established relays that
//! are already running are aborted with them.

use std::net::{TcpListener, UdpSocket};
use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::ca::TlsState;
use crate::config::{CaMaterial, EgressConfig};
use crate::decision_log::DecisionLog;
use crate::error::EgressError;
use crate::intercept::RuleState;
use crate::outbound::Outbound;
use crate::resolver::ResolvedNames;

/// State shared by the proxy and resolver tasks of one VM. Read-only after construction
/// except for the interior caches (resolved names, leaf certificates, log bucket).
pub(crate) struct Inner {
    pub(crate) cfg: EgressConfig,
    pub(crate) outbound: Outbound,
    pub(crate) log: DecisionLog,
    pub(crate) names: ResolvedNames,
    pub(crate) tls: TlsState,
    pub(crate) rules: Vec<RuleState>,
    /// Every task of this VM, so that shutdown reaches relays too.
    pub(crate) tasks: tokio_util_lite::TaskSet,
    /// The rate of upstream connections ([`Inner::connect_remote`]).
    pub(crate) connects: crate::pace::Pace,
    /// The rate of upstream DNS lookups (`crate::resolver::lookup`).
    pub(crate) lookups: crate::pace::Pace,
}

impl Inner {
    /// An upstream connection to `addr`, a destination the guest chose
    /// ([`Outbound::tcp_connect_remote`]), in its turn under the VM's connection rate.
    pub(crate) async fn connect_remote(
        &self,
        addr: std::net::SocketAddrV4,
    ) -> std::io::Result<tokio::net::TcpStream> {
        self.connects.take().await;
        self.outbound.tcp_connect_remote(addr).await
    }

    /// Whether TLS connections to `host` are terminated (it has secrets or rules, or every
    /// TLS connection is).
    pub(crate) fn intercepts(&self, host: &str) -> bool {
        self.cfg.intercept_all_tls
            || self
                .cfg
                .secrets
                .iter()
                .any(|s| crate::policy::any_matches(&s.hosts, host))
            || self.rules.iter().any(|r| r.rule.host.matches(host))
    }
}

/// The egress of one VM (policy, resolver, proxy, secrets, interception).
pub struct Egress {
    inner: Arc<Inner>,
}

/// The sockets the egress serves, all already bound (normally inside the VM's namespace,
/// see [`crate::bind_tcp_in`]). Any may be `None`.
#[derive(Debug, Default)]
pub struct Listeners {
    /// Where nftables redirects the guest's TCP.
    pub proxy: Option<TcpListener>,
    /// Where guest DNS over UDP is redirected.
    pub dns_udp: Option<UdpSocket>,
    /// Where guest DNS over TCP is redirected.
    pub dns_tcp: Option<TcpListener>,
}

impl Egress {
    /// Validates `config`, loads or generates the VM CA, and prepares the TLS configs. Serves
    /// nothing yet.
    pub fn new(config: EgressConfig, outbound: Outbound) -> Result<Self, EgressError> {
        config.validate()?;
        let tls = TlsState::new(
            config.ca.clone(),
            &config.upstream_roots,
            config.host_roots.as_deref(),
        )?;
        let rules = config
            .intercepts
            .iter()
            .cloned()
            .map(|rule| RuleState {
                rule,
                lock: tokio::sync::Mutex::new(()),
            })
            .collect();
        let log = DecisionLog::new(&config.vm, config.log_burst, config.log_per_second);
        Ok(Egress {
            inner: Arc::new(Inner {
                cfg: config,
                outbound,
                log,
                names: ResolvedNames::default(),
                tls,
                rules,
                tasks: tokio_util_lite::TaskSet::default(),
                connects: crate::pace::Pace::new(
                    crate::pace::CONNECT_RATE,
                    crate::pace::CONNECT_BURST,
                ),
                lookups: crate::pace::Pace::new(
                    crate::pace::LOOKUP_RATE,
                    crate::pace::LOOKUP_BURST,
                ),
            }),
        })
    }

    /// The VM CA (certificate for the guest's trust store, key to persist on the host).
    pub fn ca(&self) -> &CaMaterial {
        &self.inner.tls.ca
    }

    /// The VM CA certificate, PEM, to install in the guest.
    pub fn ca_cert_pem(&self) -> &str {
        &self.ca().cert_pem
    }

    /// Starts serving on `listeners` (must be called inside a tokio runtime). Listener
    /// sockets are switched to non-blocking mode here.
    pub fn spawn(&self, listeners: Listeners) -> Result<EgressHandle, EgressError> {
        let inner = &self.inner;
        if let Some(l) = listeners.proxy {
            l.set_nonblocking(true).map_err(EgressError::Listener)?;
            let l = tokio::net::TcpListener::from_std(l).map_err(EgressError::Listener)?;
            let i = inner.clone();
            inner
                .tasks
                .spawn(async move { crate::proxy::serve(i, l).await });
        }
        if let Some(s) = listeners.dns_udp {
            s.set_nonblocking(true).map_err(EgressError::Listener)?;
            let s = tokio::net::UdpSocket::from_std(s).map_err(EgressError::Listener)?;
            let i = inner.clone();
            inner.tasks.spawn(async move {
                if let Err(e) = crate::resolver::serve_udp(i.clone(), s).await {
                    tracing::error!(vm = %i.cfg.vm, error = %e, "DNS (UDP) service stopped");
                }
            });
        }
        if let Some(l) = listeners.dns_tcp {
            l.set_nonblocking(true).map_err(EgressError::Listener)?;
            let l = tokio::net::TcpListener::from_std(l).map_err(EgressError::Listener)?;
            let i = inner.clone();
            inner.tasks.spawn(async move {
                if let Err(e) = crate::resolver::serve_tcp(i.clone(), l).await {
                    tracing::error!(vm = %i.cfg.vm, error = %e, "DNS (TCP) service stopped");
                }
            });
        }
        Ok(EgressHandle {
            inner: inner.clone(),
        })
    }
}

/// Running egress of one VM; dropping it stops every task (listeners and relays).
pub struct EgressHandle {
    inner: Arc<Inner>,
}

impl EgressHandle {
    /// Stops every task of this VM now.
    pub fn shutdown(&self) {
        self.inner.tasks.abort_all();
    }
}

impl Drop for EgressHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A tiny abortable task set (spawned tasks remove nothing; finished handles are pruned on
/// each spawn).
pub(crate) mod tokio_util_lite {
    use super::JoinHandle;
    use std::future::Future;
    use std::sync::Mutex;

    /// Guards the list of handles; held only to push, prune or abort.
    #[derive(Default)]
    pub(crate) struct TaskSet(Mutex<Vec<JoinHandle<()>>>);

    impl TaskSet {
        pub(crate) fn spawn<F: Future<Output = ()> + Send + 'static>(&self, f: F) {
            let h = tokio::spawn(f);
            let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
            v.retain(|h| !h.is_finished());
            v.push(h);
        }

        pub(crate) fn abort_all(&self) {
            let v = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
            for h in v {
                h.abort();
            }
        }
    }
}
