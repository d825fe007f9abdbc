//! Generated ids → text deltas, with stop sequences matched on the text (so a stop string
//! split across tokens is found) and held back while it could still be starting.

/// Turns ids into text incrementally: a window of ids is decoded each time (byte-level BPE
/// decodes a window to the same characters it decodes the whole to, once it is past the
/// window's first token), and a trailing U+FFFD (a character split across tokens) waits.
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self { ids: Vec::new(), prefix: 0, read: 0 }
    }

    /// Adds one id; returns the new complete text (possibly empty).
    pub fn push(&mut self, id: u32, decode: &dyn Fn(&[u32]) -> Option<String>) -> String {
        self.ids.push(id);
        let before = decode(&self.ids[self.prefix..self.read]).unwrap_or_default();
        let now = decode(&self.ids[self.prefix..]).unwrap_or_default();
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            if let Some(delta) = now.get(before.len()..).filter(|_| now.starts_with(&before)) {
                let delta = delta.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                return delta;
            }
        }
        String::new()
    }
}

impl Default for Detokenizer {
    fn default() -> Self {
        Self::new()
    }
}

/// What a new piece of text produced.
#[derive(Debug, PartialEq, Eq)]
pub struct Emit {
    /// Text safe to send now.
    pub text: String,
    /// A stop sequence was found: `text` ends right before it and generation must end.
    pub stopped: bool,
}

/// Finds stop sequences in the generated text and holds back a tail that may begin one.
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` already emitted.
    emitted: usize,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), text: String::new(), emitted: 0 }
    }

    pub fn push(&mut self, piece: &str) -> Emit {
        self.text.push_str(piece);
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop can start at most `longest - 1` bytes before the new piece.
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p)).min();
        if let Some(at) = hit {
            let at = at.max(self.emitted);
            let text = self.text[self.emitted..at].to_string();
            self.emitted = self.text.len();
            return Emit { text, stopped: true };
        }
        let hold = self.held_tail();
        let end = (self.text.len() - hold).max(self.emitted);
        let text = self.text[self.emitted..end].to_string();
        self.emitted = end;
        Emit { text, stopped: false }
    }

    /// Whatever is still held (generation ended for another reason).
    pub fn flush(&mut self) -> String {
        let text = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        text
    }

    /// The longest suffix of the text that is a proper prefix of some stop sequence.
    fn held_tail(&self) -> usize {
        let t = &self.text[self.emitted..];
        let mut best = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > best && t.ends_with(&s[..k]) {
                    best = k;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let e = m.push(p);
            out.push_str(&e.text);
            if e.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_across_token_boundaries() {
        assert_eq!(run(&["END"], &["one E", "N", "D two"]), ("one ".into(), true));
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(run(&["xyz", "b"], &["aaa", "b"]), ("aaa".into(), true));
    }

    #[test]
    fn near_misses_are_released() {
        assert_eq!(run(&["END"], &["E", "N", "x"]), ("ENx".into(), false));
        assert_eq!(run(&["END"], &["the E"]), ("the E".into(), false));
        assert_eq!(run(&[], &["héllo", " wörld"]), ("héllo wörld".into(), false));
        assert_eq!(run(&["ö"], &["héllo", " wörld"]), ("héllo w".into(), true));
    }

    #[test]
    fn detokenizer_waits_for_whole_characters() {
        // A fake decoder: id 1 = "a", ids 2, 3 = the two halves of "é".
        let decode = |ids: &[u32]| -> Option<String> {
            let mut bytes = Vec::new();
            for &i in ids {
                match i {
                    1 => bytes.push(b'a'),
                    2 => bytes.push(0xC3),
                    3 => bytes.push(0xA9),
                    _ => return None,
                }
            }
            Some(String::from_utf8_lossy(&bytes).into_owned())
        };
        let mut d = Detokenizer::new();
        assert_eq!(d.push(1, &decode), "a");
        assert_eq!(d.push(2, &decode), "");
        assert_eq!(d.push(3, &decode), "é");
        assert_eq!(d.push(1, &decode), "a");
    }
}
