//! `bench cuda`'s command line and `report` (no GPU needed): bad arguments are refused
//! before any work with clap's exit code 2, bad inputs are errors (exit 1) and never
//! panics, and the merged table's ratios are the inputs' ratios.

use serde_json::{json, Value};
use veloxquant_cuda::bench::main_with_args;

fn call(args: &[&str]) -> i32 {
    let argv: Vec<String> = std::iter::once("bench cuda").chain(args.iter().copied()).map(String::from).collect();
    main_with_args(&argv)
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vq-bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn bad_command_lines_are_refused_before_any_work() {
    for args in [
        &["run", "--iters", "0"][..],
        &["run", "--iters", "many"],
        &["run", "--blocks-per-sm", "0"],
        &["run", "--no-such-flag"],
        &["report"],
        &["encode", "turboquant_mse:4", "0"],
        &["run", "--shapes", "6"],
        &["run", "--shapes", "0,bogus"],
        &["run", "--shapes", "1x0x8x32768"],
        &["run", "--shapes", "1x32x0x32768"],
        &["run", "--shapes", "1x32x6x32768"],
        &["run", "--shapes", "1x32x8x0"],
        &["run", "--shapes", "1x32x8"],
        &["run", "--shapes", "ragged:4"],
        &["run", "--shapes", "ragged:65:0"],
        &["run", "--shapes", "ragged:0:x"],
        &["frobnicate"],
        &[],
    ] {
        assert_eq!(call(args), 2, "{args:?}");
    }
}

fn decode_row(format: &str, s: u64, us: f64, graph_us: f64, bytes: f64) -> Value {
    json!({"b": 1, "hq": 32, "hkv": 8, "d": 128, "s": s, "format": format, "k_bits": 4.25, "v_bits": 4.25,
           "ours_us": us, "ours_graph_us": graph_us, "bytes": bytes})
}

#[test]
fn report_merges_rounds_and_divides_by_the_peer() {
    // Two rounds of ours (the best median per mode wins), one of the peer.
    let a = json!({"device": "test", "read_tbps": 4.0, "copy_tbps": 3.0,
                   "decode": [decode_row("q4_0", 32768, 100.0, 90.0, 2e8)], "encode": []});
    let b = json!({"device": "test", "read_tbps": 4.5, "copy_tbps": 3.0,
                   "decode": [decode_row("q4_0", 32768, 80.0, 95.0, 2e8)], "encode": []});
    let peer = json!({"rows": [{"b": 1, "hq": 32, "hkv": 8, "s": 32768, "peer_us": 400.0, "backend": "flash",
                                "peer_graph_us": 360.0, "graph_backend": "cudnn"}]});
    let (pa, pb, pp, out) = (tmp("a.json"), tmp("b.json"), tmp("p.json"), tmp("final.json"));
    for (p, v) in [(&pa, &a), (&pb, &b), (&pp, &peer)] {
        std::fs::write(p, v.to_string()).unwrap();
    }
    let ours = format!("{},{}", pa.display(), pb.display());
    assert_eq!(call(&["report", "--ours", &ours, "--peer", pp.to_str().unwrap(), "--out", out.to_str().unwrap()]), 0);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let r = &v["rows"][0];
    assert_eq!(r["ours_us"], 80.0);
    assert_eq!(r["ours_graph_us"], 90.0);
    assert_eq!(r["speedup"], 400.0 / 80.0);
    assert_eq!(r["speedup_graph"], 360.0 / 90.0);
    assert_eq!(r["peer_backend"], "flash");
    let tbps = 2e8 / 80.0 / 1e6;
    assert_eq!(r["tbps"], tbps);
    assert_eq!(r["bw_fraction"], tbps / 4.5, "the best read probe over rounds");
    let left: Vec<_> = std::fs::read_dir(out.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");

    // Missing files, non-JSON and rows without their numbers: errors, not panics.
    let (bad, broken) = (tmp("bad.json"), tmp("broken.json"));
    std::fs::write(&bad, "{ not json").unwrap();
    let mut row = decode_row("q4_0", 1024, 10.0, 9.0, 1e6);
    row.as_object_mut().unwrap().remove("bytes");
    std::fs::write(&broken, json!({"read_tbps": 1.0, "decode": [row]}).to_string()).unwrap();
    for p in [tmp("absent.json"), bad, broken] {
        assert_eq!(call(&["report", "--ours", p.to_str().unwrap()]), 1, "{}", p.display());
    }
    std::fs::remove_dir_all(out.parent().unwrap()).ok();
}

#[test]
fn report_keeps_the_ragged_case_apart_from_the_uniform_shape() {
    // The same (B, Hq, Hkv, S) twice, uniform and ragged: each meets its own peer row; rows
    // written before the ragged case (no `case`) count as uniform.
    let mut ragged = decode_row("q4_0", 32768, 50.0, 40.0, 1e8);
    let extra = json!({"case": "ragged", "lens": [32768, 1031], "sink": 4, "recent": 128});
    ragged.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    // The ragged lengths without an exact window (`--shapes ragged:0:0`): its own row, the
    // same peer row.
    let mut no_window = ragged.clone();
    no_window
        .as_object_mut()
        .unwrap()
        .extend(json!({"sink": 0, "recent": 0, "ours_graph_us": 20.0}).as_object().unwrap().clone());
    let ours = json!({"device": "test", "read_tbps": 4.0, "copy_tbps": 3.0,
                      "decode": [decode_row("q4_0", 32768, 100.0, 90.0, 2e8), ragged, no_window], "encode": []});
    let peer = json!({"rows": [
        {"b": 1, "hq": 32, "hkv": 8, "s": 32768, "peer_us": 400.0, "backend": "flash", "peer_graph_us": 360.0, "graph_backend": "flash"},
        {"b": 1, "hq": 32, "hkv": 8, "s": 32768, "case": "ragged", "peer_us": 300.0, "backend": "cudnn", "peer_graph_us": 200.0, "graph_backend": "cudnn"}]});
    let (po, pp, out) = (tmp("ro.json"), tmp("rp.json"), tmp("rfinal.json"));
    std::fs::write(&po, ours.to_string()).unwrap();
    std::fs::write(&pp, peer.to_string()).unwrap();
    assert_eq!(
        call(&[
            "report",
            "--ours",
            po.to_str().unwrap(),
            "--peer",
            pp.to_str().unwrap(),
            "--out",
            out.to_str().unwrap()
        ]),
        0
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    let by_case =
        |c: &str| rows.iter().find(|r| r["case"].as_str().unwrap_or("uniform") == c && r["recent"] != 0).unwrap();
    let bare = rows.iter().find(|r| r["recent"] == 0).unwrap();
    assert_eq!(bare["speedup_graph"], 200.0 / 20.0);
    assert_eq!(by_case("uniform")["speedup_graph"], 360.0 / 90.0);
    assert_eq!(by_case("ragged")["speedup_graph"], 200.0 / 40.0);
    assert_eq!(by_case("ragged")["speedup"], 300.0 / 50.0);
    assert_eq!(by_case("ragged")["lens"], json!([32768, 1031]));
    for p in [po, pp, out] {
        std::fs::remove_file(p).ok(); // not the folder: the other report test may be using it
    }
}
