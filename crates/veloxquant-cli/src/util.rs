//! Small helpers: errors, spec lists, statistics, tables, progress bars.

use std::io::Write;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use veloxquant::format::FormatSpec;

use crate::check::ArgError;
use crate::files::write_atomic;

pub type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Format specs from `--{arg}` (default: every registered variant).
pub fn parse_specs(arg: &'static str, list: &Option<Vec<String>>) -> Result<Vec<FormatSpec>, ArgError> {
    match list {
        None => Ok(veloxquant::format::variants()),
        Some(v) => {
            crate::check::nonempty(arg, v)?;
            v.iter()
                .map(|s| FormatSpec::parse(s).map_err(|source| ArgError::Spec { arg, value: s.clone(), source }))
                .collect()
        }
    }
}

pub fn progress(len: u64, msg: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} {elapsed}").expect("static template"));
    pb.set_message(msg.to_string());
    pb
}

/// (median, p10, p90) of a sample; NaN for an empty one.
pub fn quantiles(xs: &[f64]) -> (f64, f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (at(0.5), at(0.1), at(0.9))
}

pub fn write_json(path: &Path, value: &serde_json::Value) -> AnyResult {
    write_atomic(path, |w| Ok(w.write_all((serde_json::to_string_pretty(value)? + "\n").as_bytes())?))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// The rows of JSON array files (earlier `--json` outputs), in order.
pub fn read_json_rows(paths: &[PathBuf]) -> AnyResult<Vec<serde_json::Value>> {
    let mut rows = Vec::new();
    for p in paths {
        let v: serde_json::Value = serde_json::from_slice(&crate::files::read_bounded(p, "JSON", 64 << 20)?)
            .map_err(|e| format!("{}: {e}", p.display()))?;
        match v {
            serde_json::Value::Array(r) if !r.is_empty() => rows.extend(r),
            _ => return Err(format!("{}: not a --json output (a non-empty array)", p.display()).into()),
        }
    }
    Ok(rows)
}

/// Rows as an aligned Markdown table.
pub fn markdown_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells.iter().enumerate().map(|(i, c)| format!("{c:>w$}", w = w[i])).collect();
        format!("| {} |\n", padded.join(" | "))
    };
    let mut out = line(&header.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    out += &format!("|{}|\n", w.iter().map(|n| format!("{}:", "-".repeat(n + 1))).collect::<Vec<_>>().join("|"));
    for r in rows {
        out += &line(r);
    }
    out
}

/// Print a Markdown table, and also write it to `md` when given.
pub fn print_table_to(header: &[&str], rows: &[Vec<String>], md: Option<&Path>) -> AnyResult {
    let t = markdown_table(header, rows);
    print!("{t}");
    if let Some(p) = md {
        write_atomic(p, |w| Ok(w.write_all(t.as_bytes())?))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
