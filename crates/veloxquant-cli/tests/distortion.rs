//! The `distortion` command end to end: its JSON must land on shared/REFERENCE.md §2.

use std::process::Command;

#[test]
fn distortion_json_matches_turboquant_theory() {
    let dir = std::env::temp_dir().join(format!("vq-dist-{}", std::process::id()));
    let json = dir.join("d.json");
    let out = Command::new(env!("CARGO_BIN_EXE_veloxquant"))
        .args(["distortion", "--d", "128", "--n", "20000", "--json"])
        .arg(&json)
        .output()
        .expect("run veloxquant");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    // REFERENCE.md §2, d = 128 (exact Beta codebook) and d → ∞ (Gaussian codebook) columns.
    let d128 = [0.360889, 0.116000, 0.033966, 0.009315];
    let dinf = [0.363380, 0.117482, 0.034548, 0.009501];
    let mut seen = 0;
    for r in &rows {
        for key in ["format", "bits", "d", "bits_per_value", "mse", "ip_err", "ip_slope", "theory_mse"] {
            assert!(r.get(key).is_some(), "missing {key} in {r}");
        }
        if r["family"] != "turboquant_mse" {
            continue;
        }
        let b = r["bits"].as_u64().unwrap() as usize;
        let (mse, slope) = (r["mse"].as_f64().unwrap(), r["ip_slope"].as_f64().unwrap());
        if r["format"].as_str().unwrap().ends_with(":eden") {
            assert!((slope - 1.0).abs() < 0.01, "{r}: EDEN slope {slope}");
        } else {
            let near = |x: f64| (mse - x).abs() / x < 0.02;
            assert!(near(d128[b - 1]) || near(dinf[b - 1]), "{r}: mse {mse}");
            assert!((slope - (1.0 - mse)).abs() < 0.01, "{r}: slope {slope} vs 1 − mse");
            assert_eq!(r["theory_mse"].as_f64(), Some(dinf[b - 1]));
        }
        seen += 1;
    }
    assert_eq!(seen, 8, "4 bit widths × plain/eden");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_arguments_fail_cleanly() {
    let out = Command::new(env!("CARGO_BIN_EXE_veloxquant"))
        .args(["distortion", "--formats", "turboquant_mse:7"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unsupported bit width 7"), "{err}");
    let out =
        Command::new(env!("CARGO_BIN_EXE_veloxquant")).args(["bench", "cpu", "--shapes", "32:5:128"]).output().unwrap();
    assert!(!out.status.success());
}
