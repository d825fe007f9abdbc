//! Per-layer methods on the command line: one K/V pair per layer, inline or from a file.
//!
//! - inline: `K/V|K/V|…[@R][+S]`, one pair per layer in order, `N*K/V` for N layers in a
//!   row, V defaulting to K: `2*turboquant_frac:4/turboquant_frac:3|28*turboquant_frac:3@8+4`;
//! - a file: `PATH.json[@R][+S]`, as `veloxquant allocate` writes it: `{"layers": [["K",
//!   "V"], …], "recent": R, "sink": S, …}`; an `@R` / `+S` given after the path overrides
//!   the file's window and sinks. The table shows the file's stem.

use std::path::Path;

use veloxquant::{FormatSpec, LayerSpec};

use crate::model::Method;
use crate::util::AnyResult;

/// Layer specs at most (bounds the `N*` repetition before anything is allocated).
const MAX_LAYERS: usize = 4096;

/// A per-layer method, or `None` when `s` is not one (then it is `KSPEC[/VSPEC][@R][+S]`).
pub fn parse(s: &str) -> AnyResult<Option<Method>> {
    let (body, recent, sink) = split_window(s)?;
    if body.ends_with(".json") {
        return from_file(Path::new(body), recent, sink).map(Some);
    }
    if !body.contains('|') && !body.contains('*') {
        return Ok(None);
    }
    let mut layers = Vec::new();
    for group in body.split('|') {
        let (n, pair) = match group.split_once('*') {
            Some((n, p)) => (n.parse::<usize>().map_err(|_| format!("{s:?}: {n:?} before '*' is not a count"))?, p),
            None => (1, group),
        };
        if n == 0 || layers.len() + n > MAX_LAYERS {
            return Err(format!("{s:?}: layer count must be 1..={MAX_LAYERS}").into());
        }
        let spec = pair_of(pair)?;
        layers.extend(std::iter::repeat_n(spec, n));
    }
    let label = compact(&layers);
    Ok(Some(Method::PerLayer { layers, recent: recent.unwrap_or(0), sink: sink.unwrap_or(0), label }))
}

/// `BODY[@R][+S]` → (BODY, R, S).
fn split_window(s: &str) -> AnyResult<(&str, Option<usize>, Option<usize>)> {
    let num = |t: &str, what: &str| t.parse::<usize>().map_err(|_| format!("method {s:?}: {what} must be a number"));
    let (rest, sink) = match s.rsplit_once('+') {
        Some((a, n)) => (a, Some(num(n, "S after '+'")?)),
        None => (s, None),
    };
    let (body, recent) = match rest.rsplit_once('@') {
        Some((a, r)) => (a, Some(num(r, "R after '@'")?)),
        None => (rest, None),
    };
    Ok((body, recent, sink))
}

fn pair_of(p: &str) -> AnyResult<LayerSpec> {
    Ok(match p.split_once('/') {
        Some((k, v)) => LayerSpec::new(FormatSpec::parse(k)?, FormatSpec::parse(v)?),
        None => LayerSpec::new(FormatSpec::parse(p)?, FormatSpec::parse(p)?),
    })
}

/// The inline form of a layer list, runs of equal pairs as `N*K/V`.
pub fn compact(layers: &[LayerSpec]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let n = layers[i..].iter().take_while(|l| **l == layers[i]).count();
        let pair = if layers[i].k == layers[i].v {
            layers[i].k.to_string()
        } else {
            format!("{}/{}", layers[i].k, layers[i].v)
        };
        out.push(if n > 1 { format!("{n}*{pair}") } else { pair });
        i += n;
    }
    out.join("|")
}

fn from_file(path: &Path, recent: Option<usize>, sink: Option<usize>) -> AnyResult<Method> {
    let bytes = crate::files::read_bounded(path, "method file", 1 << 20)?;
    let text = String::from_utf8(bytes).map_err(|_| format!("{}: not UTF-8", path.display()))?;
    let j: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |why: &str| format!("{}: {why}", path.display());
    let list = j["layers"].as_array().ok_or_else(|| bad("no \"layers\" list"))?;
    if list.is_empty() || list.len() > MAX_LAYERS {
        return Err(bad("\"layers\" must hold 1 to 4096 [K, V] pairs").into());
    }
    let layers = list
        .iter()
        .map(|p| match (p[0].as_str(), p[1].as_str()) {
            (Some(k), Some(v)) => Ok(LayerSpec::new(FormatSpec::parse(k)?, FormatSpec::parse(v)?)),
            _ => Err(bad("each layer is [\"KSPEC\", \"VSPEC\"]").into()),
        })
        .collect::<AnyResult<Vec<_>>>()?;
    let field = |k: &str| j[k].as_u64().map(|v| v as usize);
    let label = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| compact(&layers));
    Ok(Method::PerLayer {
        layers,
        recent: recent.or(field("recent")).unwrap_or(0),
        sink: sink.or(field("sink")).unwrap_or(0),
        label,
    })
}

/// The file [`parse`] reads: the layer list, window and sinks, plus the caller's fields.
pub fn to_json(layers: &[LayerSpec], recent: usize, sink: usize, extra: serde_json::Value) -> serde_json::Value {
    let mut j = serde_json::json!({
        "layers": layers.iter().map(|l| [l.k.to_string(), l.v.to_string()]).collect::<Vec<_>>(),
        "recent": recent,
        "sink": sink,
        "inline": compact(layers),
    });
    if let (Some(o), serde_json::Value::Object(e)) = (j.as_object_mut(), extra) {
        o.extend(e);
    }
    j
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_lists_expand_and_print_back() {
        let m = parse("2*turboquant_frac:4/turboquant_frac:3|q4_0:rot|turboquant_mse:2@8+4").unwrap().unwrap();
        let Method::PerLayer { layers, recent, sink, label } = &m else { panic!("{m:?}") };
        assert_eq!((layers.len(), *recent, *sink), (4, 8, 4));
        assert_eq!(layers[1].v, FormatSpec::parse("turboquant_frac:3").unwrap());
        assert_eq!(layers[2].v, FormatSpec::parse("q4_0:rot").unwrap());
        assert_eq!(label, "2*turboquant_frac:4/turboquant_frac:3|q4_0:rot|turboquant_mse:2");
        assert_eq!(m.to_string(), format!("{label}@8+4"));
        assert_eq!(parse(&m.to_string()).unwrap().unwrap(), m);
        assert!(parse("turboquant_mse:4@8").unwrap().is_none(), "not a per-layer method");
        for bad in ["0*fp16|fp16", "x*fp16|fp16", "fp16|nope", "5000*fp16", "fp16|fp16@x"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn files_round_trip_and_window_overrides() {
        let layers: Vec<LayerSpec> = ["turboquant_frac:3.5:center", "turboquant_frac:2.5"]
            .iter()
            .map(|s| LayerSpec::new(FormatSpec::parse(s).unwrap(), FormatSpec::parse("turboquant_mse:3").unwrap()))
            .collect();
        let dir = std::env::temp_dir().join(format!("vq-per-layer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("alloc-3.5.json");
        let j = to_json(&layers, 8, 4, serde_json::json!({"budget": 3.5}));
        std::fs::write(&path, j.to_string()).unwrap();
        let m = parse(path.to_str().unwrap()).unwrap().unwrap();
        assert_eq!(m, Method::PerLayer { layers: layers.clone(), recent: 8, sink: 4, label: "alloc-3.5".into() });
        let m = parse(&format!("{}@16", path.display())).unwrap().unwrap();
        assert!(matches!(m, Method::PerLayer { recent: 16, sink: 4, .. }));
        std::fs::write(&path, r#"{"layers": [["fp16"]]}"#).unwrap();
        assert!(parse(path.to_str().unwrap()).is_err());
        assert!(parse(dir.join("missing.json").to_str().unwrap()).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
