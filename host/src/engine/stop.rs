//! Stop sequences over streamed text.
//!
//! Text is released to the client only when it can no longer be the start of a
//! stop sequence; when a stop sequence completes, the text before it is
//! released and the rest (the stop sequence included) is dropped, as OpenAI does.

/// Most stop sequences per request (as OpenAI); the API enforces both limits.
pub const STOPS_MAX: usize = 4;
/// Longest stop sequence, in bytes.
pub const STOP_BYTES_MAX: usize = 256;

/// What [`StopMatcher::push`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Scan {
    /// Text that is safe to release (possibly empty).
    Text(String),
    /// A stop sequence completed; this text precedes it and ends the stream.
    Stopped(String),
}

/// Holds back text that may begin a stop sequence.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds newly decoded text.
    pub fn push(&mut self, text: &str) -> Scan {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return Scan::Text(std::mem::take(&mut self.held));
        }
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first_stop {
            let before = self.held[..at].to_string();
            self.held.clear();
            return Scan::Stopped(before);
        }
        // Keep the longest suffix that is a proper prefix of some stop sequence.
        let keep = self.longest_partial_suffix();
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.drain(..release);
        Scan::Text(text)
    }

    /// Text still held back when the stream ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn longest_partial_suffix(&self) -> usize {
        let held = self.held.as_str();
        let mut best = 0;
        for stop in &self.stops {
            for len in (1..stop.len().min(held.len() + 1)).rev() {
                if len <= best {
                    break;
                }
                let start = held.len() - len;
                if held.is_char_boundary(start) && stop.starts_with(&held[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_text_when_no_stop_is_possible() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello "), Scan::Text("hello ".into()));
        assert_eq!(m.push("wor"), Scan::Text("wor".into()));
    }

    #[test]
    fn holds_a_partial_stop_and_cuts_at_a_complete_one() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("abc E"), Scan::Text("abc ".into()));
        assert_eq!(m.push("N"), Scan::Text(String::new()));
        assert_eq!(m.push("Dxyz"), Scan::Stopped("".into()));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("aEN"), Scan::Text("a".into()));
        assert_eq!(
            m.push("X"),
            Scan::Text("ENX".into()),
            "a broken prefix is released"
        );
        assert_eq!(m.push("1\n\nEND"), Scan::Stopped("1\n\n".into()));
    }

    #[test]
    fn finish_flushes_held_text_and_no_stops_pass_everything() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("ST"), Scan::Text(String::new()));
        assert_eq!(m.finish(), "ST");
        let mut m = StopMatcher::new(vec![String::new()]);
        assert_eq!(m.push("anything"), Scan::Text("anything".into()));
    }

    #[test]
    fn handles_multibyte_text_without_splitting_characters() {
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("caf"), Scan::Text("caf".into()));
        assert_eq!(m.push("é"), Scan::Text(String::new()));
        assert_eq!(m.push("?"), Scan::Text("é?".into()));
        assert_eq!(m.push("ké!"), Scan::Stopped("k".into()));
    }
}
