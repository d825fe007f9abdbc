mod common;

#[test]
fn round_trip_varied_text() {
    let Some(l) = common::loaded() else { return };
    let texts = [
        "Hello, world!",
        "  leading spaces and trailing   ",
        "tabs\tand\r\nCRLF\r\n\r\n lines\n\n\n",
        "numbers 3.14159 and 1,000,000 and ٣٤ and ½",
        "unicode: naïve café, Ελληνικά, русский, 日本語, 한국어, emoji 🦀🚀",
        " = Valkyria Chronicles III = \r\n \r\n Senjō no Valkyria 3 : <unk> Chronicles",
        "code: fn main() { println!(\"{}\", 42); } // 'quoted' it's we're",
        "",
    ];
    for t in texts {
        let ids = l.tok.encode(t).unwrap();
        assert_eq!(l.tok.decode(&ids).unwrap(), t, "ids {ids:?}");
    }
}

#[test]
fn digits_are_split_singly_and_known_ids() {
    let Some(l) = common::loaded() else { return };
    let id = |s: &str| l.tok.token_id(s).unwrap_or_else(|| panic!("{s} not in vocab"));
    // Every digit its own token (smollm pre-tokenizer), even after a space.
    let ids = l.tok.encode("12345").unwrap();
    assert_eq!(ids, ["1", "2", "3", "4", "5"].map(id));
    let ids = l.tok.encode("in 2024").unwrap();
    assert_eq!(ids, [id("in"), id("Ġ"), id("2"), id("0"), id("2"), id("4")]);
    // Whole words map to single vocabulary entries (Ġ marks the leading space).
    assert_eq!(l.tok.encode("Hello world").unwrap(), [id("Hello"), id("Ġworld")]);
    assert_eq!(l.tok.add_bos, None, "SmolLM2 GGUF adds no BOS");
    assert_eq!(l.tok.n_vocab(), 49_152);
    assert!(l.tok.is_control(id("<|im_start|>")));
}

#[test]
fn special_token_text_is_not_parsed() {
    let Some(l) = common::loaded() else { return };
    let ids = l.tok.encode("<|im_start|>").unwrap();
    assert!(ids.len() > 1, "special text must tokenize as plain text: {ids:?}");
}
