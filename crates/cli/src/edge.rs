//! `cvol serve`'s network edge: TLS (`--tls`, `--tls-certificates`,
//! `--tls-verify-peer`), which TCP peers may connect (`--allow`), the
//! warning when a volume is served to the network without client
//! authentication (no TLS, or TLS without client certificates), and the
//! reload of certificates on SIGHUP. The flags and their meaning follow
//! nbdkit's, so scripts and certificates carry over.
use crate::error::Error;
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
    /// Clients must present a certificate signed by DIR/ca-cert.pem (with
    /// --tls require: the only setting that authenticates clients).
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

/// The TCP listener's reach, as far as the edge flags care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// No TCP listener (only `--socket`: file permissions decide).
    NoTcp,
    /// A loopback address: only this machine's users and processes.
    Loopback,
    /// Any other address: other machines.
    Network,
}

impl Reach {
    pub fn of(addr: SocketAddr) -> Reach {
        if addr.ip().to_canonical().is_loopback() {
            Reach::Loopback
        } else {
            Reach::Network
        }
    }

    /// The reach of a listener on every one of `addrs` (what `--listen`
    /// resolves to): the network if any is not loopback.
    pub fn of_all(addrs: impl IntoIterator<Item = SocketAddr>) -> Reach {
        match addrs.into_iter().all(|a| Reach::of(a) == Reach::Loopback) {
            true => Reach::Loopback,
            false => Reach::Network,
        }
    }
}

/// The edge flags as the checks see them (no files read): what
/// [`assess`] judges.
#[derive(Clone, Copy, Debug)]
pub struct EdgePlan {
    pub tls: TlsFlag,
    pub certificates: bool,
    pub verify_peer: bool,
    pub psk: bool,
    pub allow: bool,
    /// `--read-only`: clients can read the volume, not change it.
    pub read_only: bool,
}

/// Refuses flag combinations that cannot work or that would look
/// authenticated and not be. `tcp`: whether a TCP listener is served.
pub fn check(p: &EdgePlan, tcp: bool) -> Result<(), Error> {
    if p.psk {
        return Err(Error::Usage(
            "--tls-psk: TLS with pre-shared keys is not supported (rustls, cvol's TLS \
             library, has no server-side PSK); use --tls-certificates DIR with x509 \
             certificates"
                .into(),
        ));
    }
    match (p.tls, p.certificates) {
        (TlsFlag::On | TlsFlag::Require, false) => {
            return Err(Error::Usage(format!(
            "--tls {}: needs --tls-certificates DIR (ca-cert.pem, server-cert.pem, server-key.pem)",
            tls_word(p.tls)
        )))
        }
        (TlsFlag::Off, true) => {
            return Err(Error::Usage(
                "--tls-certificates: TLS is off; add --tls require (or --tls on)".into(),
            ))
        }
        _ => {}
    }
    match p.tls {
        TlsFlag::Off if p.verify_peer => {
            return Err(Error::Usage(
                "--tls-verify-peer: TLS is off; add --tls require --tls-certificates DIR".into(),
            ))
        }
        TlsFlag::On if p.verify_peer => {
            return Err(Error::Usage(
                "--tls-verify-peer with --tls on: clients may skip TLS, and with it the \
                 certificate check, so a client without a certificate would still be served; \
                 use --tls require --tls-verify-peer"
                    .into(),
            ))
        }
        _ => {}
    }
    if p.allow && !tcp {
        return Err(Error::Usage(
            "--allow filters TCP clients, and only --socket is served; add --listen ADDR:PORT or drop --allow"
                .into(),
        ));
    }
    Ok(())
}

/// What is wrong with serving `addr` (of reach `reach`) this way, for a
/// warning at start: a listener other machines reach whose clients are
/// not authenticated (no TLS, optional TLS, or TLS without client
/// certificates). None when clients must present a certificate, or the
/// listener is loopback or absent.
pub fn exposure(p: &EdgePlan, reach: Reach, addr: &str) -> Option<String> {
    if reach != Reach::Network || (p.tls == TlsFlag::Require && p.verify_peer) {
        return None;
    }
    let who = if p.allow {
        "any client at an allowed address (--allow)"
    } else {
        "anyone who can reach it"
    };
    let can = if p.read_only {
        "read the whole volume"
    } else {
        "read and overwrite the whole volume"
    };
    let how = match p.tls {
        TlsFlag::Off => "without TLS: no client is authenticated and traffic is in the clear",
        TlsFlag::On => {
            "with optional TLS (--tls on): no client is authenticated and clients \
             may go in the clear"
        }
        TlsFlag::Require => {
            "with TLS but no client certificates (no --tls-verify-peer): traffic is \
             encrypted, but no client is authenticated"
        }
    };
    let fix = if p.tls == TlsFlag::Require {
        "Add --tls-verify-peer (clients then need a certificate signed by ca-cert.pem)"
    } else {
        "Require client certificates with --tls require --tls-certificates DIR \
         --tls-verify-peer"
    };
    Some(format!(
        "WARNING: {addr} is served to the network {how}; {who} can {can}. {fix}, or \
         serve on --listen 127.0.0.1:PORT or --socket PATH."
    ))
}

/// Judges the edge flags of a start whose TCP listener `addr` has reach
/// `reach`: refused ([`check`]'s reason), or served with these warnings
/// ([`exposure`]).
pub fn assess(p: &EdgePlan, reach: Reach, addr: &str) -> Result<Vec<String>, Error> {
    check(p, reach != Reach::NoTcp)?;
    Ok(exposure(p, reach, addr).into_iter().collect())
}

/// `--tls`'s value as written on the command line.
fn tls_word(t: TlsFlag) -> String {
    clap::ValueEnum::to_possible_value(&t).map_or_else(String::new, |v| v.get_name().to_string())
}

impl EdgeFlags {
    pub fn plan(&self, read_only: bool) -> EdgePlan {
        EdgePlan {
            tls: self.tls,
            certificates: self.tls_certificates.is_some(),
            verify_peer: self.tls_verify_peer,
            psk: self.tls_psk.is_some(),
            allow: self.allow.is_some(),
            read_only,
        }
    }

    /// Judges the flags ([`assess`]; its warnings are logged, loudly, on
    /// stderr) and loads the certificates into `config`. `reach` and
    /// `addr`: the TCP listener's (`--listen`).
    pub fn apply(
        &self,
        config: &mut ServerConfig,
        read_only: bool,
        reach: Reach,
        addr: &str,
    ) -> Result<(), Error> {
        for w in assess(&self.plan(read_only), reach, addr)? {
            tracing::warn!("{w}");
        }
        let mode = match self.tls {
            TlsFlag::Off => None,
            TlsFlag::On => Some(TlsMode::On),
            TlsFlag::Require => Some(TlsMode::Require),
        };
        if let (Some(mode), Some(dir)) = (mode, &self.tls_certificates) {
            let credentials = TlsCredentials::load(dir, self.tls_verify_peer)
                .map_err(|e| Error::Usage(format!("--tls-certificates: {e}")))?;
            config.tls = Some(TlsSettings {
                mode,
                credentials: Arc::new(credentials),
            });
        }
        if let Some(list) = &self.allow {
            config.allow = Some(parse_allow(list)?);
        }
        Ok(())
    }

    pub fn tls_enabled(&self) -> bool {
        self.tls != TlsFlag::Off
    }
}

/// `--allow`: comma-separated networks; a bare address is a /32 (/128).
pub fn parse_allow(list: &str) -> Result<Vec<ipnet::IpNet>, Error> {
    let mut nets = Vec::new();
    for item in list.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(Error::Usage(format!("--allow {list}: an empty entry")));
        }
        let net = item
            .parse::<ipnet::IpNet>()
            .or_else(|_| item.parse::<IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| Error::Usage({
                format!(
                    "--allow {list}: '{item}' is neither an address nor a network (e.g. 10.0.0.0/8, 192.168.1.5, ::1)"
                )
            }))?;
        nets.push(net.trunc());
    }
    Ok(nets)
}

/// SIGHUP (`systemctl reload`) re-reads the certificates; without TLS it
/// is logged and ignored (a server does not die of it).
pub struct Reloader {
    credentials: Option<Arc<TlsCredentials>>,
    hup: Arc<AtomicBool>,
}

impl Reloader {
    pub fn install(config: &ServerConfig) -> Result<Reloader, Error> {
        let hup = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGHUP, hup.clone())
            .map_err(|e| Error::io("SIGHUP handler", e))?;
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
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        edge: EdgeFlags,
        #[arg(long)]
        read_only: bool,
    }

    /// What a start does with a set of flags.
    #[derive(Debug)]
    enum Outcome {
        /// Refused; the reason holds this text.
        Refused(&'static str),
        /// Served, with a warning holding this text.
        Warned(&'static str),
        /// Served, nothing to say.
        Served,
    }
    use Outcome::{Refused, Served, Warned};
    use Reach::{Loopback, Network, NoTcp};

    const CERTS: &str = "--tls-certificates=/pki";

    /// Every TLS-related flag combination that matters, and its outcome:
    /// the table docs/SERVING.md "Serving to the network" gives users.
    const TABLE: &[(&[&str], Reach, Outcome)] = &[
        // Refused: flags that cannot work or would look authenticated and not be.
        (
            &["--tls-psk=/k"],
            Loopback,
            Refused("pre-shared keys is not supported"),
        ),
        (
            &["--tls=require", CERTS, "--tls-psk=/k"],
            Network,
            Refused("--tls-psk"),
        ),
        (
            &["--tls=on"],
            Loopback,
            Refused("--tls on: needs --tls-certificates"),
        ),
        (
            &["--tls=require"],
            Network,
            Refused("--tls require: needs --tls-certificates"),
        ),
        (&[CERTS], Network, Refused("--tls-certificates: TLS is off")),
        (
            &["--tls-verify-peer"],
            Network,
            Refused("--tls-verify-peer: TLS is off"),
        ),
        (
            &[CERTS, "--tls-verify-peer"],
            Network,
            Refused("TLS is off"),
        ),
        (
            &["--tls=on", CERTS, "--tls-verify-peer"],
            Network,
            Refused("use --tls require --tls-verify-peer"),
        ),
        (
            &["--tls=on", CERTS, "--tls-verify-peer"],
            Loopback,
            Refused("with --tls on"),
        ),
        (
            &["--tls=on", CERTS, "--tls-verify-peer"],
            NoTcp,
            Refused("with --tls on"),
        ),
        (
            &["--allow=10.0.0.0/8"],
            NoTcp,
            Refused("--allow filters TCP clients"),
        ),
        // Warned: other machines reach it, and no client is authenticated.
        (
            &[],
            Network,
            Warned("without TLS: no client is authenticated"),
        ),
        (
            &["--allow=10.0.0.0/8"],
            Network,
            Warned("any client at an allowed address"),
        ),
        (
            &["--read-only"],
            Network,
            Warned("can read the whole volume"),
        ),
        (
            &["--tls=on", CERTS],
            Network,
            Warned("optional TLS (--tls on)"),
        ),
        (
            &["--tls=on", CERTS, "--read-only"],
            Network,
            Warned("optional TLS"),
        ),
        (
            &["--tls=require", CERTS],
            Network,
            Warned("Add --tls-verify-peer"),
        ),
        (
            &["--tls=require", CERTS, "--allow=10.0.0.0/8"],
            Network,
            Warned("no client certificates"),
        ),
        (
            &["--tls=require", CERTS, "--read-only"],
            Network,
            Warned("can read the whole volume"),
        ),
        // Served: clients authenticated, or not reachable from other machines.
        (
            &["--tls=require", CERTS, "--tls-verify-peer"],
            Network,
            Served,
        ),
        (
            &[
                "--tls=require",
                CERTS,
                "--tls-verify-peer",
                "--allow=10.0.0.0/8",
            ],
            Network,
            Served,
        ),
        (
            &["--tls=require", CERTS, "--tls-verify-peer", "--read-only"],
            Network,
            Served,
        ),
        (
            &["--tls=require", CERTS, "--tls-verify-peer"],
            NoTcp,
            Served,
        ),
        (
            &["--tls=require", CERTS, "--tls-verify-peer"],
            Loopback,
            Served,
        ),
        (&["--tls=require", CERTS], Loopback, Served),
        (&["--tls=require", CERTS], NoTcp, Served),
        (&["--tls=on", CERTS], Loopback, Served),
        (&[], Loopback, Served),
        (&[], NoTcp, Served),
        (&["--allow=127.0.0.1"], Loopback, Served),
    ];

    /// Each row of [`TABLE`] is refused, warned or served as it says.
    #[test]
    fn tls_flag_combinations_are_refused_warned_or_served() {
        for (flags, reach, want) in TABLE {
            let cmd = Cmd::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()))
                .unwrap_or_else(|e| panic!("{flags:?}: {e}"));
            let got = assess(&cmd.edge.plan(cmd.read_only), *reach, "ADDR");
            let ok = match (&got, want) {
                (Err(e), Refused(why)) => e.to_string().contains(why),
                (Ok(w), Warned(why)) => w.len() == 1 && w[0].contains(why),
                (Ok(w), Served) => w.is_empty(),
                _ => false,
            };
            assert!(ok, "{flags:?} on {reach:?}: want {want:?}, got {got:?}");
        }
    }

    #[test]
    fn the_warning_names_the_address_and_recommends_client_certificates() {
        let plan = |tls, verify_peer| EdgePlan {
            tls,
            certificates: tls != TlsFlag::Off,
            verify_peer,
            psk: false,
            allow: false,
            read_only: false,
        };
        let w = exposure(&plan(TlsFlag::Off, false), Network, "0.0.0.0:10809").unwrap();
        assert!(
            w.starts_with("WARNING: 0.0.0.0:10809 is served to the network"),
            "{w}"
        );
        assert!(
            w.contains("--tls require --tls-certificates DIR --tls-verify-peer"),
            "{w}"
        );
        assert!(w.contains("read and overwrite"), "{w}");
        let w = exposure(&plan(TlsFlag::Require, false), Network, "[::]:1").unwrap();
        assert!(w.contains("--tls-verify-peer"), "{w}");
        assert_eq!(exposure(&plan(TlsFlag::Require, true), Network, "x"), None);
        // Reach of bound addresses: any loopback (v4, v6, v4-mapped) is local.
        for (a, r) in [
            ("127.0.0.1:1", Loopback),
            ("127.5.0.1:1", Loopback),
            ("[::1]:1", Loopback),
            ("[::ffff:127.0.0.1]:1", Loopback),
            ("0.0.0.0:1", Network),
            ("[::]:1", Network),
            ("10.1.2.3:1", Network),
        ] {
            assert_eq!(Reach::of(a.parse().unwrap()), r, "{a}");
        }
        let all = |a: &[&str]| Reach::of_all(a.iter().map(|a| a.parse().unwrap()));
        assert_eq!(all(&["127.0.0.1:1", "[::1]:1"]), Loopback);
        assert_eq!(all(&["127.0.0.1:1", "10.0.0.1:1"]), Network);
    }

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
            let e = parse_allow(bad).unwrap_err().to_string();
            assert!(e.starts_with("--allow"), "{bad}: {e}");
        }
        assert!(parse_allow("nonsense")
            .unwrap_err()
            .to_string()
            .contains("'nonsense'"));
    }
}
