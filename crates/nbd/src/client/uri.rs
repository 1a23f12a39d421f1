//! NBD URIs: `nbd://HOST[:PORT][/EXPORT]` and
//! `nbd+unix:///EXPORT?socket=PATH`, with %-escapes.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

use super::DEFAULT_PORT;
use crate::proto;

/// Error message of a URI that is not one of the accepted forms.
pub(super) const ACCEPTED_FORMS: &str =
    "accepted forms: nbd://HOST[:PORT][/EXPORT] and nbd+unix:///EXPORT?socket=PATH";

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Endpoint {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Target {
    pub(super) endpoint: Endpoint,
    pub(super) export: String,
}

fn bad_uri(uri: &str, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{uri}: {why}; {ACCEPTED_FORMS}"),
    )
}

/// Decodes `%XX` escapes.
fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

/// The export name of a URI path ("" or "/NAME"), percent-decoded.
fn parse_export(uri: &str, path: &str) -> io::Result<String> {
    let name = path.strip_prefix('/').unwrap_or(path);
    let bytes = percent_decode(name).ok_or_else(|| bad_uri(uri, "bad %-escape in export"))?;
    proto::parse_string(&bytes).map_err(|_| bad_uri(uri, "export name is not a valid NBD string"))
}

fn parse_tcp(uri: &str, rest: &str) -> io::Result<Target> {
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    if path.contains(['?', '#']) || authority.contains(['?', '#', '@']) {
        return Err(bad_uri(uri, "nbd:// takes no query, fragment or user"));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, tail) = v6
            .split_once(']')
            .ok_or_else(|| bad_uri(uri, "unclosed [ in host"))?;
        (
            host,
            tail.strip_prefix(':').or(tail.is_empty().then_some("")),
        )
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, Some("")),
        }
    };
    let port = match port {
        Some("") => DEFAULT_PORT,
        Some(p) => p.parse().map_err(|_| bad_uri(uri, "bad port"))?,
        None => return Err(bad_uri(uri, "junk after ]")),
    };
    if host.is_empty() {
        return Err(bad_uri(uri, "no host"));
    }
    let endpoint = Endpoint::Tcp {
        host: host.to_owned(),
        port,
    };
    let export = parse_export(uri, path)?;
    Ok(Target { endpoint, export })
}

fn parse_unix(uri: &str, rest: &str) -> io::Result<Target> {
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if !(path.is_empty() || path.starts_with('/')) || query.contains('#') {
        return Err(bad_uri(uri, "nbd+unix:// takes no host or fragment"));
    }
    let mut socket = None;
    for param in query.split('&').filter(|p| !p.is_empty()) {
        match param.split_once('=') {
            Some(("socket", value)) if !value.is_empty() => {
                let bytes =
                    percent_decode(value).ok_or_else(|| bad_uri(uri, "bad %-escape in socket"))?;
                socket = Some(PathBuf::from(OsString::from_vec(bytes)));
            }
            _ => return Err(bad_uri(uri, &format!("unknown query parameter {param:?}"))),
        }
    }
    let socket = socket.ok_or_else(|| bad_uri(uri, "missing socket=PATH"))?;
    let export = parse_export(uri, path)?;
    Ok(Target {
        endpoint: Endpoint::Unix(socket),
        export,
    })
}

/// Parses an NBD URI (see [`Client::connect`]).
pub(super) fn parse_uri(uri: &str) -> io::Result<Target> {
    if let Some(rest) = uri.strip_prefix("nbd://") {
        parse_tcp(uri, rest)
    } else if let Some(rest) = uri.strip_prefix("nbd+unix://") {
        parse_unix(uri, rest)
    } else {
        Err(bad_uri(uri, "unsupported NBD URI"))
    }
}
