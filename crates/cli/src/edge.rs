//! `cvol serve`'s network edge: TLS (`--tls`, `--tls-certificates`,
//! `--tls-verify-peer`), which TCP peers may connect (`--allow`), the
//! warning when a volume is served to the network in the clear, and the
//! reload of certificates on SIGHUP. The flags and their meaning follow
//! nbdkit's, so scripts and certificates carry over.
use cvol_nbd::tls::{TlsCredentials, TlsMode, TlsSettings};
use cvol_nbd::ServerConfig;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TlsFlag {
    /// No TLS: STARTTLS is refused.
    Off,
    /// TLS offered; clients may also go without.
    On,
    /// TLS required: nothing is listed or served before it.
    Require,
}

/// Who may reach the NBD server, and how.
#[derive(clap::Args)]
pub struct EdgeFlags {
    /// TLS for NBD clients (nbds:// URIs): off, on (offered) or require
    /// (no export is listed or served before TLS). Needs --tls-certificates.
    #[arg(long, value_enum, default_value = "off")]
    tls: TlsFlag,
    /// Directory of ca-cert.pem, server-cert.pem and server-key.pem (the
    /// layout of nbdkit and qemu); re-read on SIGHUP for new connections.
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Clients must present a certificate signed by DIR/ca-cert.pem.
    #[arg(long)]
    tls_verify_peer: bool,
    /// TLS with a pre-shared key (nbdkit's username:hexkey file): not
    /// supported (rustls has no server-side PSK); refused with that reason.
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// TCP clients allowed to connect: addresses or networks (CIDR),
    /// comma-separated, e.g. 10.0.0.0/8,::1. Others are closed at once.
    #[arg(long, value_name = "CIDR[,CIDR...]")]
    allow: Option<String>,
}

impl EdgeFlags {
    /// Checks the flags and loads the certificates into `config`. `tcp`:
    /// whether a TCP listener is served (`--allow` filters only TCP).
    pub fn apply(&self, config: &mut ServerConfig, tcp: bool) -> Result<(), String> {
        if self.tls_psk.is_some() {
            return Err(
                "--tls-psk: TLS with pre-shared keys is not supported (rustls, cvol's TLS \
                        library, has no server-side PSK); use --tls-certificates DIR with x509 \
                        certificates"
                    .into(),
            );
        }
        let mode = match self.tls {
            TlsFlag::Off => None,
            TlsFlag::On => Some(TlsMode::On),
            TlsFlag::Require => Some(TlsMode::Require),
        };
        match (mode, &self.tls_certificates) {
            (Some(mode), Some(dir)) => {
                let credentials = TlsCredentials::load(dir, self.tls_verify_peer)
                    .map_err(|e| format!("--tls-certificates: {e}"))?;
                config.tls = Some(TlsSettings {
                    mode,
                    credentials: Arc::new(credentials),
                });
            }
            (Some(_), None) => {
                return Err(format!(
                    "--tls {}: needs --tls-certificates DIR (ca-cert.pem, server-cert.pem, server-key.pem)",
                    self.tls_word()
                ))
            }
            (None, Some(_)) => {
                return Err(
                    "--tls-certificates: TLS is off; add --tls require (or --tls on)".into(),
                )
            }
            (None, None) if self.tls_verify_peer => {
                return Err("--tls-verify-peer: TLS is off; add --tls require --tls-certificates DIR".into())
            }
            (None, None) => {}
        }
        if let Some(list) = &self.allow {
            if !tcp {
                return Err(
                    "--allow filters TCP clients, and only --socket is served; add --listen ADDR:PORT or drop --allow"
                        .into(),
                );
            }
            config.allow = Some(parse_allow(list)?);
        }
        Ok(())
    }

    /// `--tls`'s value as written on the command line.
    fn tls_word(&self) -> String {
        clap::ValueEnum::to_possible_value(&self.tls)
            .map_or_else(String::new, |v| v.get_name().to_string())
    }

    pub fn tls_enabled(&self) -> bool {
        self.tls != TlsFlag::Off
    }
}

/// `--allow`: comma-separated networks; a bare address is a /32 (/128).
pub fn parse_allow(list: &str) -> Result<Vec<ipnet::IpNet>, String> {
    let mut nets = Vec::new();
    for item in list.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(format!("--allow {list}: an empty entry"));
        }
        let net = item
            .parse::<ipnet::IpNet>()
            .or_else(|_| item.parse::<IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                format!(
                    "--allow {list}: '{item}' is neither an address nor a network (e.g. 10.0.0.0/8, 192.168.1.5, ::1)"
                )
            })?;
        nets.push(net.trunc());
    }
    Ok(nets)
}

/// Warns loudly when `addr` is reachable from other machines and clients
/// may use it without TLS: anyone who reaches it can read and overwrite
/// the whole volume.
pub fn warn_if_exposed(addr: SocketAddr, config: &ServerConfig) {
    let ip = addr.ip().to_canonical();
    if ip.is_loopback() {
        return;
    }
    let required = config
        .tls
        .as_ref()
        .is_some_and(|t| t.mode == TlsMode::Require);
    if required {
        return;
    }
    let who = match &config.allow {
        Some(_) => "any allowed client (--allow)",
        None => "anyone who can reach it",
    };
    let how = if config.tls.is_some() {
        "TLS is optional (--tls on)"
    } else {
        "without TLS"
    };
    tracing::warn!(
        "WARNING: {addr} is served to the network {how}: {who} can read and overwrite the whole \
         volume in the clear. Use --tls require --tls-certificates DIR, or --listen 127.0.0.1:PORT."
    );
}

/// SIGHUP (`systemctl reload`) re-reads the certificates; without TLS it
/// is logged and ignored (a server does not die of it).
pub struct Reloader {
    credentials: Option<Arc<TlsCredentials>>,
    hup: Arc<AtomicBool>,
}

impl Reloader {
    pub fn install(config: &ServerConfig) -> Result<Reloader, String> {
        let hup = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGHUP, hup.clone())
            .map_err(|e| format!("SIGHUP handler: {e}"))?;
        Ok(Reloader {
            credentials: config.tls.as_ref().map(|t| t.credentials.clone()),
            hup,
        })
    }

    /// Reloads if a SIGHUP came since the last call; a failed reload keeps
    /// the certificates in use.
    pub fn poll(&self) {
        if !self.hup.swap(false, Ordering::SeqCst) {
            return;
        }
        let Some(credentials) = &self.credentials else {
            tracing::info!("SIGHUP: nothing to reload (no TLS)");
            return;
        };
        let dir = credentials.dir().display();
        match credentials.reload() {
            Ok(()) => tracing::info!("SIGHUP: TLS certificates reloaded from {dir}"),
            Err(e) => tracing::error!(
                "SIGHUP: TLS certificates not reloaded ({e}); the previous ones stay in use"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_takes_networks_and_bare_addresses() {
        let nets = parse_allow("10.0.0.0/8, 192.168.1.5,::1,fe80::1/64").unwrap();
        let has = |ip: &str| {
            nets.iter()
                .any(|n| n.contains(&ip.parse::<IpAddr>().unwrap()))
        };
        assert!(has("10.200.3.4"));
        assert!(has("192.168.1.5"));
        assert!(!has("192.168.1.6"));
        assert!(has("::1"));
        assert!(has("fe80::abcd"));
        assert!(!has("127.0.0.1"));
        // A network written with host bits is the network.
        assert_eq!(
            parse_allow("10.1.2.3/8").unwrap()[0].to_string(),
            "10.0.0.0/8"
        );
    }

    #[test]
    fn allow_names_the_bad_entry() {
        for bad in ["", "10.0.0.0/33", "nonsense", "10.0.0.0/8,", "1.2.3"] {
            let e = parse_allow(bad).unwrap_err();
            assert!(e.starts_with("--allow"), "{bad}: {e}");
        }
        assert!(parse_allow("nonsense").unwrap_err().contains("'nonsense'"));
    }
}
