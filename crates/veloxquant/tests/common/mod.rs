//! Shared helpers for the integration tests: every registered format with each bit width.

use veloxquant::format::{FormatSpec, REGISTRY};

/// Every (format, bits, options) variant worth testing.
pub fn all_specs() -> Vec<FormatSpec> {
    let mut out = Vec::new();
    for desc in REGISTRY {
        let bits: Vec<Option<u32>> =
            if desc.bits.is_empty() { vec![None] } else { desc.bits.iter().map(|&b| Some(b)).collect() };
        for b in bits {
            let base = match b {
                Some(b) => format!("{}:{b}", desc.name),
                None => desc.name.to_string(),
            };
            out.push(FormatSpec::parse(&base).unwrap());
            if desc.rotatable {
                out.push(FormatSpec::parse(&format!("{base}:rot")).unwrap());
            }
            if desc.has_norm_mode {
                out.push(FormatSpec::parse(&format!("{base}:eden")).unwrap());
            }
        }
    }
    out
}

/// max |a − b| / max |b|: relative error against the reference's scale.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs())) / scale
}
