//! Byte sizes as people write them (`8GiB`, `512MiB`, `1.5 GB`, `4096`) and as the tables
//! print them.

/// Parses a size: a non-negative number (decimals allowed) and an optional unit, case-
/// insensitive, with or without a space: `B`; binary `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024,
/// also written `K`, `M`, `G`, `T`, as `ulimit` and PyTorch's `max_split_size_mb` do); decimal
/// `KB`, `MB`, `GB`, `TB` (powers of 1000, as the `bytesize` crate and disk vendors). No unit:
/// bytes. Returns bytes (rounded down).
///
/// # Errors
/// A message naming the text and what was expected, for an empty text, a number that is not
/// finite and non-negative, an unknown unit, or a size beyond `u64`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let expected = "a size such as 8GiB, 512MiB, 1.5GB or 4096 (bytes)";
    let value: f64 = number.parse().map_err(|_| format!("invalid size {text:?}: expected {expected}"))?;
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => {
            return Err(format!(
                "invalid size {text:?}: unknown unit {unit:?}; expected B, KiB, MiB, GiB, TiB (1024s) or KB, MB, GB, TB (1000s)"
            ))
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("invalid size {text:?}: expected {expected}, at most 16 EiB"));
    }
    Ok(bytes as u64)
}

/// `bytes` in MiB with two decimals: `4.58 MiB`.
pub fn format_mib(bytes: u64) -> String {
    format!("{:.2} MiB", super::mib(bytes))
}

/// `bytes` in the largest binary unit under which it is at least 1, two decimals: `8.00 GiB`,
/// `512.00 MiB`, `100 B`.
pub fn format_size(bytes: u64) -> String {
    let units = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = None;
    for u in units {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = Some(u);
    }
    match unit {
        None => format!("{bytes} B"),
        Some(u) => format!("{value:.2} {u}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5gb"), Ok(1_500_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2k"), Ok(2048));
        assert_eq!(parse_size(" 1 TB "), Ok(1_000_000_000_000));
        for bad in ["", "GiB", "-1GiB", "8 gibibytes", "1.2.3MiB", "1e3", "99999999999999EiB"] {
            assert!(parse_size(bad).unwrap_err().starts_with(&format!("invalid size {bad:?}")), "{bad}");
        }
        assert_eq!(format_size(8 << 30), "8.00 GiB");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_size(100), "100 B");
        assert_eq!(format_mib(4_799_528), "4.58 MiB");
    }
}
