//! Reading usage out of a response body as it streams through, never holding it: a JSON
//! document's numbers at given JSON pointers ([`Json`]), or the same in each event of an event
//! stream ([`Events`]: `text/event-stream`, the `data:` lines of an event one document). Pure
//! bytes in, numbers out: the rules' charges (`rules::charge`) feed it, the config parses its
//! pointers.
//!
//! Every byte of the body is examined once, by a push state machine whose memory is fixed: a
//! stack of at most [`MAX_DEPTH`] containers, a key of at most [`MAX_SEGMENT`] bytes (a longer
//! key matches no pointer), a number of at most 20 digits (past `u64` it saturates). Keys are
//! compared as written between their quotes (a key spelt with escapes matches no pointer).
//! Must never: buffer the body, grow with it, or panic on any bytes.

use smallvec::SmallVec;

/// Containers nested deeper than this end the scan (the document is unread).
pub const MAX_DEPTH: usize = 64;
/// Key bytes compared; a longer key matches nothing.
pub const MAX_SEGMENT: usize = 64;
/// Pointers one rule sums.
pub const MAX_POINTERS: usize = 8;

/// One step of a JSON pointer: a key, or (all digits) also an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    key: Box<[u8]>,
    index: Option<u32>,
}

/// The JSON pointers a rule reads (RFC 6901: `/usage/total_tokens`, `~1` for `/`, `~0` for `~`),
/// and their text as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pointers(Vec<Vec<Segment>>, Vec<String>);

/// What a body's usage is read at by default: an OpenAI-compatible answer's total.
pub const OPENAI: &[&str] = &["/usage/total_tokens"];
/// Anthropic's: the input in `message_start`, the output (a running total) in `message_delta`.
pub const ANTHROPIC: &[&str] = &["/message/usage/input_tokens", "/usage/output_tokens"];

impl Pointers {
    /// The pointers as given.
    pub fn text(&self) -> &[String] {
        &self.1
    }

    /// Parses `pointers`, or a shape's name (`openai`, `anthropic`) alone; says what is wrong
    /// with the first one that is not a pointer.
    pub fn parse<'a>(pointers: impl IntoIterator<Item = &'a str>) -> Result<Pointers, String> {
        let given: Vec<&str> = pointers.into_iter().collect();
        let given = match given[..] {
            ["openai"] => OPENAI.to_vec(),
            ["anthropic"] => ANTHROPIC.to_vec(),
            _ => given,
        };
        let mut out = Vec::new();
        for &p in &given {
            if !p.starts_with('/') {
                return Err(format!(
                    "{p:?}: a JSON pointer starts with / (e.g. /usage/total_tokens), or give openai or anthropic"
                ));
            }
            let mut segments = Vec::new();
            for raw in p[1..].split('/') {
                let mut key = Vec::with_capacity(raw.len());
                let mut bytes = raw.bytes();
                while let Some(b) = bytes.next() {
                    match (b, b == b'~') {
                        (_, false) => key.push(b),
                        _ => match bytes.next() {
                            Some(b'0') => key.push(b'~'),
                            Some(b'1') => key.push(b'/'),
                            _ => return Err(format!("{p:?}: ~ must be written ~0 (and / as ~1)")),
                        },
                    }
                }
                if key.len() > MAX_SEGMENT {
                    return Err(format!("{p:?}: a key of at most {MAX_SEGMENT} bytes"));
                }
                let index = (!key.is_empty()
                    && key.iter().all(u8::is_ascii_digit)
                    && (key.len() == 1 || key[0] != b'0'))
                    .then(|| std::str::from_utf8(&key).ok()?.parse().ok())
                    .flatten();
                segments.push(Segment {
                    key: key.into(),
                    index,
                });
            }
            if segments.len() >= MAX_DEPTH {
                return Err(format!("{p:?}: at most {} steps deep", MAX_DEPTH - 1));
            }
            out.push(segments);
        }
        if out.is_empty() || out.len() > MAX_POINTERS {
            return Err(format!(
                "give 1 to {MAX_POINTERS} JSON pointers, or openai or anthropic"
            ));
        }
        Ok(Pointers(out, given.iter().map(|p| p.to_string()).collect()))
    }

    fn all(&self) -> u8 {
        ((1u16 << self.0.len()) - 1) as u8
    }
}

/// What a scan found at one pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Found {
    /// Not there (or `null`).
    #[default]
    None,
    /// A whole number of at least 0.
    Number(u64),
    /// Something else: a string, a fraction, a negative, an object.
    Bad,
}

#[derive(Debug, Clone, Copy)]
struct Frame {
    array: bool,
    /// The pointers whose first steps are this container's path.
    live: u8,
    /// The element now being read, in an array.
    index: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// A value is due (whitespace first).
    Value,
    /// In a string: a key's, or a value's; after a backslash.
    Str { key: bool, escaped: bool },
    /// In a number (a target's digits accumulate).
    Number,
    /// In `true`, `false` or `null`.
    Word,
    /// After `[`: a value or `]`.
    FirstElement,
    /// After a value: `,`, or the container's end.
    After,
    /// After `{`: a key or `}`.
    FirstKey,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// The document is over: whitespace only.
    Done,
    /// Not JSON, or too deep: nothing more is read.
    Failed,
}

/// A scan of one JSON document.
#[derive(Debug, Clone)]
pub struct Json {
    state: State,
    stack: SmallVec<[Frame; 8]>,
    /// The key being read (up to [`MAX_SEGMENT`] bytes), and whether it was longer.
    key: SmallVec<[u8; MAX_SEGMENT]>,
    key_long: bool,
    /// Pointers the value being read (or the key's value to come) is the end of, and those
    /// it is on the way to.
    target: u8,
    via: u8,
    number: Number,
    found: [Found; MAX_POINTERS],
}

/// A number being read at a target: its value, and whether it is still a whole number >= 0.
#[derive(Debug, Clone, Copy, Default)]
struct Number {
    value: u64,
    whole: bool,
    digits: bool,
}

impl Json {
    /// A scan for `pointers`.
    pub fn new(pointers: &Pointers) -> Json {
        Json {
            state: State::Value,
            stack: SmallVec::new(),
            key: SmallVec::new(),
            key_long: false,
            // Every pointer has a step: the root is on the way to each, the end of none.
            target: 0,
            via: pointers.all(),
            number: Number::default(),
            found: [Found::None; MAX_POINTERS],
        }
    }

    /// Whether the whole document was read.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// What was found at each pointer (by the pointers' order), so far.
    pub fn found(&self) -> &[Found] {
        &self.found
    }

    /// Reads `bytes` of the document.
    pub fn feed(&mut self, pointers: &Pointers, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            match self.state {
                State::Failed => return,
                // Inside a string (most of a body's bytes) only its end, an escape or a control
                // byte matters: a run up to the next is skipped, or (a key that may be on a
                // pointer's way) kept at once.
                State::Str {
                    key,
                    escaped: false,
                } => {
                    let rest = &bytes[i..];
                    let run = rest
                        .iter()
                        .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
                        .unwrap_or(rest.len());
                    if key && self.stack.last().is_some_and(|f| f.live != 0) {
                        let room = MAX_SEGMENT - self.key.len();
                        self.key.extend_from_slice(&rest[..run.min(room)]);
                        self.key_long |= run > room;
                    }
                    i += run;
                    if i == bytes.len() {
                        return;
                    }
                }
                _ => {}
            }
            self.byte(pointers, bytes[i]);
            i += 1;
        }
    }

    /// The document's end (no more bytes): a number or word at its top level ends here.
    pub fn end(&mut self) {
        if self.stack.is_empty() {
            match self.state {
                State::Number => {
                    self.close_number();
                    self.state = State::Done;
                }
                State::Word => self.state = State::Done,
                _ => {}
            }
        }
    }

    fn fail(&mut self) {
        self.state = State::Failed;
    }

    fn byte(&mut self, pointers: &Pointers, b: u8) {
        let space = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        match self.state {
            State::Failed => {}
            State::Done => {
                if !space {
                    self.fail();
                }
            }
            State::Value => self.value(pointers, b, space),
            State::FirstElement => match b {
                _ if space => {}
                b']' => {
                    self.stack.pop();
                    self.after_value();
                }
                _ => {
                    self.state = State::Value;
                    self.value(pointers, b, false);
                }
            },
            State::Str { key, escaped } => {
                if escaped {
                    self.state = State::Str {
                        key,
                        escaped: false,
                    };
                    self.key_byte(key, b);
                } else if b == b'"' {
                    if key {
                        self.end_key(pointers);
                        self.state = State::Colon;
                    } else {
                        self.after_value();
                    }
                } else if b < 0x20 {
                    self.fail();
                } else {
                    self.state = State::Str {
                        key,
                        escaped: b == b'\\',
                    };
                    self.key_byte(key, b);
                }
            }
            State::Number => {
                if b.is_ascii_digit() {
                    let n = &mut self.number;
                    n.digits = true;
                    n.value = n
                        .value
                        .saturating_mul(10)
                        .saturating_add(u64::from(b - b'0'));
                } else if matches!(b, b'.' | b'e' | b'E' | b'+' | b'-') {
                    self.number.whole = false;
                } else {
                    self.close_number();
                    self.after_value();
                    self.byte(pointers, b);
                }
            }
            State::Word => {
                if !b.is_ascii_lowercase() {
                    self.after_value();
                    self.byte(pointers, b);
                }
            }
            State::After => match b {
                _ if space => {}
                b',' => match self.stack.last_mut() {
                    Some(f) if f.array => {
                        f.index = f.index.saturating_add(1);
                        let (live, index) = (f.live, f.index);
                        self.element(pointers, live, index);
                        self.state = State::Value;
                    }
                    Some(_) => self.state = State::Key,
                    None => self.fail(),
                },
                b'}' | b']' => match self.stack.pop() {
                    Some(f) if f.array == (b == b']') => self.after_value(),
                    _ => self.fail(),
                },
                _ => self.fail(),
            },
            State::FirstKey | State::Key => match b {
                _ if space => {}
                b'"' => {
                    self.key.clear();
                    self.key_long = false;
                    self.state = State::Str {
                        key: true,
                        escaped: false,
                    };
                }
                b'}' if self.state == State::FirstKey => {
                    self.stack.pop();
                    self.after_value();
                }
                _ => self.fail(),
            },
            State::Colon => match b {
                _ if space => {}
                b':' => self.state = State::Value,
                _ => self.fail(),
            },
        }
    }

    /// A value begins with `b` (or whitespace before it). One at a pointer's end that is not a
    /// whole number is not a count of units (`null` is as good as absent).
    fn value(&mut self, pointers: &Pointers, b: u8, space: bool) {
        if space {
            return;
        }
        let target = self.target;
        match b {
            b'{' | b'[' => {
                self.mark(target, Found::Bad);
                if self.stack.len() >= MAX_DEPTH {
                    return self.fail();
                }
                let array = b == b'[';
                self.stack.push(Frame {
                    array,
                    live: self.via,
                    index: 0,
                });
                if array {
                    self.element(pointers, self.via, 0);
                    self.state = State::FirstElement;
                } else {
                    self.state = State::FirstKey;
                }
            }
            b'"' => {
                self.mark(target, Found::Bad);
                self.state = State::Str {
                    key: false,
                    escaped: false,
                };
            }
            b'-' | b'0'..=b'9' => {
                let digit = b.is_ascii_digit();
                self.number = Number {
                    value: if digit { u64::from(b - b'0') } else { 0 },
                    whole: digit,
                    digits: digit,
                };
                self.state = State::Number;
            }
            b't' | b'f' => {
                self.mark(target, Found::Bad);
                self.state = State::Word;
            }
            b'n' => {
                self.mark(target, Found::None);
                self.state = State::Word;
            }
            _ => self.fail(),
        }
    }

    fn key_byte(&mut self, key: bool, b: u8) {
        if key {
            if self.key.len() < MAX_SEGMENT {
                self.key.push(b);
            } else {
                self.key_long = true;
            }
        }
    }

    /// A key was read: which pointers its value ends or leads on.
    fn end_key(&mut self, pointers: &Pointers) {
        let depth = self.stack.len() - 1;
        let live = self.stack.last().map_or(0, |f| f.live);
        let mut via = 0u8;
        if !self.key_long {
            for (i, p) in pointers.0.iter().enumerate() {
                if live & (1 << i) != 0 && p.get(depth).is_some_and(|s| *s.key == self.key[..]) {
                    via |= 1 << i;
                }
            }
        }
        self.via = via;
        self.target = ends(pointers, via, depth + 1);
    }

    /// Element `index` of an array whose path `live` pointers lead through.
    fn element(&mut self, pointers: &Pointers, live: u8, index: u32) {
        let depth = self.stack.len() - 1;
        let mut via = 0u8;
        for (i, p) in pointers.0.iter().enumerate() {
            if live & (1 << i) != 0 && p.get(depth).is_some_and(|s| s.index == Some(index)) {
                via |= 1 << i;
            }
        }
        self.via = via;
        self.target = ends(pointers, via, depth + 1);
    }

    fn close_number(&mut self) {
        let n = self.number;
        let found = if n.whole && n.digits {
            Found::Number(n.value)
        } else {
            Found::Bad
        };
        self.mark(self.target, found);
    }

    fn mark(&mut self, target: u8, found: Found) {
        for (i, f) in self.found.iter_mut().enumerate() {
            if target & (1 << i) != 0 {
                *f = found;
            }
        }
    }

    fn after_value(&mut self) {
        self.target = 0;
        self.via = 0;
        self.state = if self.stack.is_empty() {
            State::Done
        } else {
            State::After
        };
    }
}

/// Of the pointers in `via`, those with exactly `depth` steps.
fn ends(pointers: &Pointers, via: u8, depth: usize) -> u8 {
    let mut out = 0;
    for (i, p) in pointers.0.iter().enumerate() {
        if via & (1 << i) != 0 && p.len() == depth {
            out |= 1 << i;
        }
    }
    out
}

/// Where an event stream's line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At its start, or in its field name (this many bytes of `data` matched so far).
    Field(u8),
    /// After `data:`, before the optional space.
    Colon,
    /// In a `data` line's value: fed to the event's document.
    Data,
    /// In any other line (another field, a comment): skipped.
    Skip,
}

/// A scan of an event stream: each event's `data` lines as one JSON document (an event whose
/// data is not JSON, such as `[DONE]`, is passed over), the last number found at each pointer
/// in any event standing.
#[derive(Debug, Clone)]
pub struct Events {
    line: Line,
    /// The last byte was a CR (a LF after it ends no second line).
    cr: bool,
    /// The event now being read has had a data line.
    data: bool,
    event: Json,
    found: [Found; MAX_POINTERS],
}

impl Events {
    pub fn new(pointers: &Pointers) -> Events {
        Events {
            line: Line::Field(0),
            cr: false,
            data: false,
            event: Json::new(pointers),
            found: [Found::None; MAX_POINTERS],
        }
    }

    /// What was found at each pointer in the events read whole so far.
    pub fn found(&self) -> &[Found] {
        &self.found
    }

    pub fn feed(&mut self, pointers: &Pointers, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            // The rest of a data line goes to the event's document at once; the rest of
            // another line is skipped.
            if matches!(self.line, Line::Data | Line::Skip) {
                let rest = &bytes[i..];
                let end = rest
                    .iter()
                    .position(|&c| c == b'\n' || c == b'\r')
                    .unwrap_or(rest.len());
                if end > 0 {
                    if self.line == Line::Data {
                        self.event.feed(pointers, &rest[..end]);
                    }
                    self.cr = false;
                    i += end;
                    continue;
                }
            }
            let b = bytes[i];
            i += 1;
            let cr = std::mem::replace(&mut self.cr, b == b'\r');
            if b == b'\n' && cr {
                continue;
            }
            if b == b'\n' || b == b'\r' {
                // A blank line ends the event.
                if self.line == Line::Field(0) {
                    self.dispatch(pointers);
                }
                self.line = Line::Field(0);
                continue;
            }
            self.line = match self.line {
                Line::Field(n) if n < 4 && b == b"data"[usize::from(n)] => Line::Field(n + 1),
                Line::Field(4) if b == b':' => {
                    // Lines of one event's data are joined by a line feed.
                    if std::mem::replace(&mut self.data, true) {
                        self.event.feed(pointers, b"\n");
                    }
                    Line::Colon
                }
                Line::Field(_) => Line::Skip,
                Line::Colon if b == b' ' => Line::Data,
                Line::Colon | Line::Data => {
                    self.event.feed(pointers, &[b]);
                    Line::Data
                }
                Line::Skip => Line::Skip,
            };
        }
    }

    /// The stream is over: an event left without its blank line still counts if its document
    /// is whole.
    pub fn end(&mut self, pointers: &Pointers) {
        self.dispatch(pointers);
    }

    fn dispatch(&mut self, pointers: &Pointers) {
        if std::mem::replace(&mut self.data, false) {
            self.event.end();
            if self.event.done() {
                for (kept, found) in self.found.iter_mut().zip(self.event.found()) {
                    if *found != Found::None {
                        *kept = *found;
                    }
                }
            }
        }
        self.event = Json::new(pointers);
    }
}

#[cfg(test)]
mod tests;
