mod common;

use veloxquant_llm::passkey::{extract_passkey, passkey_accuracy, passkey_prompt, PasskeyFormat};

#[test]
fn extract_first_five_digit_run() {
    assert_eq!(extract_passkey(" 12345."), Some(12345));
    assert_eq!(extract_passkey("1234 123456 54321"), Some(54321));
    assert_eq!(extract_passkey("no digits"), None);
}

#[test]
fn prompt_hits_length_and_hides_needle() {
    let Some(l) = common::loaded() else { return };
    for target in [1024, 2048, 4096, 8192] {
        for depth in [0.0, 0.5, 1.0] {
            let p = passkey_prompt(&l.tok, target, depth, 7, PasskeyFormat::Plain).unwrap();
            assert!(p.tokens.len() <= target && p.tokens.len() + 40 >= target, "{}", p.tokens.len());
            let text = l.tok.decode(&p.tokens).unwrap();
            assert!(text.contains(&format!("The pass key is {}.", p.passkey)));
            let at = text.find("The pass key is").unwrap() as f64 / text.len() as f64;
            assert!((at - depth).abs() < 0.1, "needle at {at}, depth {depth}");
        }
    }
    let a = passkey_prompt(&l.tok, 1024, 0.5, 1, PasskeyFormat::Chat).unwrap();
    let b = passkey_prompt(&l.tok, 1024, 0.5, 1, PasskeyFormat::Chat).unwrap();
    assert_eq!(a.tokens, b.tokens, "seeded");
    assert!(passkey_prompt(&l.tok, 10, 0.5, 1, PasskeyFormat::Plain).is_err());
}

#[test]
fn fp16_passkey_1k() {
    let Some(l) = common::loaded() else { return };
    // Plain text: measured 6/6 here. The ChatML template measured 0/6 (the 135M model
    // answers in words), so it is not the default.
    let mut f = common::fp16_factory(&l.model, 1024);
    let depths = [0.1, 0.5, 0.9];
    let s = passkey_accuracy(&l.model, &l.tok, &mut f, 1024, &depths, 2, 42, PasskeyFormat::Plain).unwrap();
    eprintln!("fp16 passkey 1k: {:.2} {:?}", s.accuracy(), s.per_depth);
    assert_eq!(s.n_trials, 6);
    assert!(s.n_correct >= 4, "fp16 should retrieve at 1k: {:?}", s.per_depth);
}
