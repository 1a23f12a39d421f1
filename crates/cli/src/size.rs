//! Size arguments: `4096`, `512K`, `64M`, `3G`, `1T`, `1.5G`, `64MiB`, `64m` (binary units).
use crate::error::Error;

pub fn parse_size(s: &str) -> Result<u64, Error> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(Error::Usage(format!(
            "invalid size '{s}': expected a number with an optional K/M/G/T suffix"
        )));
    }
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        "P" | "PB" | "PIB" => 50,
        _ => {
            return Err(Error::Usage(format!(
                "invalid size '{s}': unknown unit '{unit}' (use K, M, G, T)"
            )))
        }
    };
    let bytes = if num.contains('.') {
        let v: f64 = num
            .parse()
            .map_err(|_| Error::Usage(format!("invalid size '{s}'")))?;
        let b = v * (1u64 << shift) as f64;
        if !b.is_finite() || b >= u64::MAX as f64 {
            return Err(Error::Usage(format!("size '{s}' is too large")));
        }
        b.round() as u64
    } else {
        let v: u64 = num
            .parse()
            .map_err(|_| Error::Usage(format!("invalid size '{s}'")))?;
        v.checked_mul(1u64 << shift)
            .ok_or_else(|| Error::Usage(format!("size '{s}' is too large")))?
    };
    Ok(bytes)
}

/// This machine's memory (MemTotal in /proc/meminfo), if it can be read.
pub fn memory_bytes() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// A memory budget (`--read-cache`, `--dedup-memory`, ...): `s` parsed,
/// refused below `min` (0 allowed when `zero_ok`: it turns the thing off)
/// or above this machine's memory.
pub fn parse_memory(flag: &str, s: &str, min: u64, zero_ok: bool) -> Result<u64, Error> {
    let b = parse_size(s).map_err(|e| Error::Usage(format!("{flag}: {e}")))?;
    check_memory(flag, s, b, min, zero_ok, memory_bytes())
}

fn check_memory(
    flag: &str,
    s: &str,
    b: u64,
    min: u64,
    zero_ok: bool,
    total: Option<u64>,
) -> Result<u64, Error> {
    if b == 0 && zero_ok {
        return Ok(0);
    }
    if b < min {
        return Err(Error::Usage(format!(
            "{flag} {s}: at least {} is needed{}",
            crate::words::human_bytes(min),
            if zero_ok { " (or 0 for none)" } else { "" }
        )));
    }
    // Without /proc/meminfo, 16 TiB stands for "more than any machine".
    let total = total.unwrap_or(16 << 40);
    if b > total {
        return Err(Error::Usage(format!(
            "{flag} {s}: more than this machine's memory ({})",
            crate::words::human_bytes(total)
        )));
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512K").unwrap(), 512 << 10);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("3G").unwrap(), 3 << 30);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("1.5g").unwrap(), 3 << 29);
        assert_eq!(parse_size("16GiB").unwrap(), 16 << 30);
        for bad in ["", "G", "12X", "-5M", "99999999999999999999T", "1..5G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn memory_budgets_have_a_range() {
        let g = 1u64 << 30;
        let c = |s: &str, min, zero_ok| {
            check_memory(
                "--read-cache",
                s,
                parse_size(s).unwrap(),
                min,
                zero_ok,
                Some(8 * g),
            )
        };
        assert_eq!(c("0", 1 << 20, true).unwrap(), 0);
        assert_eq!(c("64M", 1 << 20, true).unwrap(), 64 << 20);
        assert_eq!(c("8G", 1 << 20, true).unwrap(), 8 * g);
        let e = c("0", 1 << 20, false).unwrap_err().to_string();
        assert!(e.contains("--read-cache 0: at least 1.0 MiB"), "{e}");
        let e = c("99999T", 1 << 20, true).unwrap_err().to_string();
        assert!(e.contains("more than this machine's memory"), "{e}");
        assert!(c("9G", 0, true).is_err());
        assert!(memory_bytes().is_some_and(|m| m > 0), "/proc/meminfo");
        assert!(parse_memory("--read-cache", "99999T", 0, true).is_err());
    }
}
