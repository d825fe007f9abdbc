//! CLI fuzz pass: random argument lists for every subcommand (numbers 0, 1, huge, negative;
//! random strings; spec-like strings; odd paths) through clap and the checks, with and
//! without a model: a clap error, a typed `ArgError` or a plan within bounds, never a panic.

use std::path::PathBuf;

use clap::Parser;
use proptest::prelude::*;

use super::{plan, Ctx, ModelInfo, Plan};
use crate::model::Method;
use crate::Cli;

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("1".to_string()),
        Just("-1".to_string()),
        Just("4".to_string()),
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("1000000000000".to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        (0u64..10_000).prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|x| x.to_string()),
    ]
}

fn spec() -> impl Strategy<Value = String> {
    let name = prop::sample::select(vec![
        "fp16",
        "q8_0",
        "q4_0",
        "turboquant_mse",
        "turboquant_prod",
        "turboquant_rvq",
        "qjl",
        "kivi",
        "rabitq",
        "vecinfer",
        "nope",
    ]);
    let opt =
        prop_oneof![number(), Just("rot".to_string()), Just("eden".to_string()), Just("2x".into()), Just("g4".into())];
    (name, prop::collection::vec(opt, 0..3), prop::option::of(number()), prop::option::of(number())).prop_map(
        |(n, opts, r, s)| {
            let mut out = std::iter::once(n.to_string()).chain(opts).collect::<Vec<_>>().join(":");
            if let Some(r) = r {
                out += &format!("@{r}");
            }
            if let Some(s) = s {
                out += &format!("+{s}");
            }
            out
        },
    )
}

fn path() -> impl Strategy<Value = String> {
    let dir = std::env::temp_dir().join("vq-fuzz-nonexistent");
    prop_oneof![
        Just(dir.join("out.json").display().to_string()),
        Just("/dev/zero".to_string()),
        Just("/dev/null".to_string()),
        Just("".to_string()),
        Just(".".to_string()),
        Just("src".to_string()),
        Just("Cargo.toml".to_string()),
        "[a-z./]{1,12}",
    ]
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => number(),
        3 => spec(),
        1 => prop::collection::vec(spec(), 1..4).prop_map(|v| v.join(",")),
        1 => prop::collection::vec(number(), 1..4).prop_map(|v| v.join(",")),
        1 => (number(), number(), number()).prop_map(|(a, b, c)| format!("{a}:{b}:{c}")),
        1 => path(),
        1 => ".{0,12}",
    ]
}

/// A subcommand, its flags, and for each chosen flag a random value.
fn argv() -> impl Strategy<Value = Vec<String>> {
    let commands: Vec<(&[&str], &[&str])> = vec![
        (&["demo"], &["--max-tokens", "--method", "--model"]),
        (&["generate"], &["--prompt", "--method", "--max-tokens"]),
        (&["eval"], &["--text", "--ctx", "--windows", "--methods", "--calib-tokens", "--json", "--plot", "--md"]),
        (&["passkey"], &["--lengths", "--methods", "--depths", "--n", "--seed", "--json", "--md"]),
        (&["fetch-model"], &["--model", "--cache-dir"]),
        (&["distortion"], &["--d", "--n", "--formats", "--json", "--plot", "--md"]),
        (&["cache", "save", "FILE"], &["--prompt", "--method", "--max-tokens"]),
        (&["cache", "load", "FILE"], &["--max-tokens"]),
        (&["cache", "inspect", "FILE"], &[]),
        (
            &["bench", "cpu"],
            &["--context", "--formats", "--shapes", "--reps", "--ref-reps", "--recent", "--json", "--md"],
        ),
        (&["bench", "model"], &["--methods", "--tests", "--depths", "--batch", "--reps", "--threads", "--json"]),
        (
            &["bench", "e2e"],
            &["--batch", "--context", "--methods", "--iters", "--fit", "--json", "--prefill-chunk", "--prefill-rows"],
        ),
        (&["bench", "e2e-report"], &["--ours", "--hf", "--json", "--md", "--svg", "--svg-context"]),
        (&["generate", "--device", "cuda"], &["--prompt", "--method", "--max-tokens"]),
        (&["eval", "--device", "cuda"], &["--text", "--ctx", "--batch", "--methods"]),
    ];
    (0..commands.len(), prop::collection::vec((any::<prop::sample::Index>(), value()), 0..6), path(), any::<bool>())
        .prop_map(move |(c, flags, file, force)| {
            let (words, opts) = &commands[c];
            let mut out = vec!["veloxquant".to_string()];
            out.extend(words.iter().map(|w| if *w == "FILE" { file.clone() } else { w.to_string() }));
            if !opts.is_empty() {
                for (i, v) in flags {
                    out.push(opts[i.index(opts.len())].to_string());
                    out.push(v);
                }
            }
            if force {
                out.push("--force".into());
            }
            out
        })
}

fn models() -> [ModelInfo; 2] {
    let path = PathBuf::from("/nonexistent/model.gguf");
    [ModelInfo { path: path.clone(), n_ctx: 8192 }, ModelInfo { path, n_ctx: 256 }]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
    #[test]
    fn every_subcommand_gives_a_typed_error_or_a_plan_within_bounds(args in argv()) {
        let Ok(cli) = Cli::try_parse_from(&args) else { return Ok(()) };
        let _ = plan(&cli.cmd, &Ctx { force: cli.force, model: None });
        for m in &models() {
            match plan(&cli.cmd, &Ctx { force: cli.force, model: Some(m) }) {
                Err(e) => prop_assert!(!e.to_string().is_empty()),
                Ok(Plan::Gen(p)) => {
                    prop_assert!(p.max_tokens < m.n_ctx, "{args:?}: {} tokens", p.max_tokens);
                    if let Method::Compressed { recent, sink, .. } = p.method {
                        prop_assert!(recent <= m.n_ctx && sink <= m.n_ctx);
                    }
                }
                Ok(Plan::Methods(ms)) => prop_assert!(!ms.is_empty()),
                Ok(Plan::Eval(p)) => {
                    prop_assert!(!p.methods.contains(&Method::Fp16));
                    prop_assert!(p.methods.iter().enumerate().all(|(i, a)| !p.methods[..i].contains(a)), "duplicates");
                }
                Ok(Plan::Specs(s)) => prop_assert!(!s.is_empty()),
                Ok(Plan::ModelBench(p)) => {
                    prop_assert!(!p.methods.is_empty() && p.threads >= 1);
                    prop_assert!(p.tests.iter().all(|t| (1..=m.n_ctx).contains(&t.n_tokens())), "{args:?}");
                }
                Ok(_) => {}
            }
        }
    }

    #[test]
    fn method_parser_gives_a_method_or_a_typed_error(s in prop_oneof![spec(), ".{0,20}"]) {
        if let Ok(m) = Method::parse("method", &s) {
            prop_assert_eq!(Method::parse("method", &m.to_string()).ok(), Some(m));
        }
    }
}
