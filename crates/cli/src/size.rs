//! Size arguments: `4096`, `512K`, `64M`, `3G`, `1T`, `1.5G`, `64MiB`, `64m` (binary units).

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "invalid size '{s}': expected a number with an optional K/M/G/T suffix"
        ));
    }
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        "P" | "PB" | "PIB" => 50,
        _ => {
            return Err(format!(
                "invalid size '{s}': unknown unit '{unit}' (use K, M, G, T)"
            ))
        }
    };
    let bytes = if num.contains('.') {
        let v: f64 = num.parse().map_err(|_| format!("invalid size '{s}'"))?;
        let b = v * (1u64 << shift) as f64;
        if !b.is_finite() || b >= u64::MAX as f64 {
            return Err(format!("size '{s}' is too large"));
        }
        b.round() as u64
    } else {
        let v: u64 = num.parse().map_err(|_| format!("invalid size '{s}'"))?;
        v.checked_mul(1u64 << shift)
            .ok_or_else(|| format!("size '{s}' is too large"))?
    };
    Ok(bytes)
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
}
