//! The data, embedded (`data/`, with its README for sources, licences and the fixed splits):
//! the digits, the six plays and their splits, and a user's text file.

use std::io::Read;

use candle_core::Result;

const DIGITS_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");
const SHAKESPEARE_GZ: &[u8] = include_bytes!("../../data/shakespeare.txt.gz");

fn gunzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .map_err(candle_core::Error::wrap)?;
    Ok(out)
}

/// The digits data set: 8x8 images scaled to [0, 1], labels 0..9.
#[derive(Debug, Clone)]
pub struct Digits {
    /// Training images, 64 values each.
    pub train_x: Vec<f32>,
    /// Training labels.
    pub train_y: Vec<u32>,
    /// Validation images.
    pub val_x: Vec<f32>,
    /// Validation labels.
    pub val_y: Vec<u32>,
}

/// Loads the digits with the fixed split: sample `i` validates iff `i % 5 == 0`.
pub fn digits() -> Result<Digits> {
    let csv = gunzip(DIGITS_GZ)?;
    let mut d = Digits {
        train_x: Vec::new(),
        train_y: Vec::new(),
        val_x: Vec::new(),
        val_y: Vec::new(),
    };
    let mut rows = csv::ReaderBuilder::new()
        .has_headers(false)
        .trim(csv::Trim::All)
        .from_reader(csv.as_slice());
    for (i, row) in rows.deserialize::<Vec<u32>>().enumerate() {
        let v = row.map_err(candle_core::Error::wrap)?;
        if v.len() != 65 {
            return Err(candle_core::Error::Msg(format!(
                "digits row {i} has {} fields",
                v.len()
            )));
        }
        let (x, y) = if i % 5 == 0 {
            (&mut d.val_x, &mut d.val_y)
        } else {
            (&mut d.train_x, &mut d.train_y)
        };
        x.extend(v[..64].iter().map(|&p| p as f32 / 16.0));
        y.push(v[64]);
    }
    Ok(d)
}

/// A text as byte-level tokens, split for training and validation.
#[derive(Debug, Clone)]
pub struct Text {
    /// Its name in reports (`shakespeare`, or the file's name).
    pub name: String,
    /// The distinct bytes, sorted: token `t` is `vocab[t]`.
    pub vocab: Vec<u8>,
    /// Training tokens (the first 90% of the bytes).
    pub train: Vec<u32>,
    /// Validation tokens (the last 10%).
    pub val: Vec<u32>,
}

impl Text {
    /// Tokenizes `bytes` (one token per distinct byte) with the fixed split: the first 90% of the
    /// bytes train, the last 10% validate. Errors if either part is too short for `context`-token
    /// windows.
    pub fn from_bytes(name: &str, bytes: &[u8], context: usize) -> Result<Text> {
        let cut = bytes.len() * 9 / 10;
        Text::held_out(name, bytes, cut..bytes.len(), context)
    }

    /// Tokenizes `bytes` (one token per distinct byte of the whole text, so both parts share the
    /// vocabulary): the bytes in `val` validate, the others (before it, then after it) train.
    /// Errors if either part is too short for `context`-token windows.
    pub fn held_out(
        name: &str,
        bytes: &[u8],
        val: std::ops::Range<usize>,
        context: usize,
    ) -> Result<Text> {
        if val.start > val.end || val.end > bytes.len() {
            return Err(candle_core::Error::Msg(format!(
                "the validation range {val:?} is not inside a text of {} bytes",
                bytes.len()
            )));
        }
        let mut vocab: Vec<u8> = bytes.to_vec();
        vocab.sort_unstable();
        vocab.dedup();
        let mut index = [0u32; 256];
        for (t, &b) in vocab.iter().enumerate() {
            index[usize::from(b)] = t as u32;
        }
        let tokens: Vec<u32> = bytes.iter().map(|&b| index[usize::from(b)]).collect();
        let mut train = tokens[..val.start].to_vec();
        train.extend_from_slice(&tokens[val.end..]);
        let text = Text {
            name: name.to_string(),
            vocab,
            train,
            val: tokens[val.clone()].to_vec(),
        };
        for (part, len) in [
            ("validation", text.val.len()),
            ("training", text.train.len()),
        ] {
            if len < context + 2 {
                return Err(candle_core::Error::Msg(format!(
                    "a text of {} bytes is too short: its {part} part ({len} bytes) must hold a \
                     window of {} bytes and one more",
                    bytes.len(),
                    context + 1
                )));
            }
        }
        Ok(text)
    }

    /// Decodes tokens back to text (bytes that are not UTF-8 are replaced).
    pub fn decode(&self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens.iter().map(|&t| self.vocab[t as usize]).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Loads the six plays (the embedded `data/shakespeare.txt.gz`) with the fixed split.
pub fn shakespeare() -> Result<Text> {
    Text::from_bytes("shakespeare", &gunzip(SHAKESPEARE_GZ)?, 64)
}

/// The six plays of the embedded text, in its order: the name each is known by here and its
/// title as the text spells it, the line before "by William Shakespeare". (The text joins each
/// play's last line to the next play's title, so a title is found with the line that follows.)
pub const PLAYS: [(&str, &str); 6] = [
    ("Hamlet", "HAMLET, PRINCE OF DENMARK"),
    ("Macbeth", "MACBETH"),
    ("Julius Caesar", "JULIUS CAESAR"),
    ("Romeo and Juliet", "ROMEO AND JULIET"),
    ("The Tempest", "THE TEMPEST"),
    ("Othello", "OTHELLO, THE MOOR OF VENICE"),
];

/// The byte range of each of [`PLAYS`] in `bytes` (the embedded text): from its title to the next
/// play's title (the last to the end).
pub fn play_ranges(bytes: &[u8]) -> Result<Vec<std::ops::Range<usize>>> {
    let find = |needle: &[u8]| bytes.windows(needle.len()).position(|w| w == needle);
    let mut starts = Vec::with_capacity(PLAYS.len());
    for (name, title) in PLAYS {
        let needle = format!("{title}\n\nby William Shakespeare");
        let at = find(needle.as_bytes()).ok_or_else(|| {
            candle_core::Error::Msg(format!("the text has no title of {name} ({title:?})"))
        })?;
        if starts.last().is_some_and(|&s| at <= s) {
            return Err(candle_core::Error::Msg(format!(
                "{name} is not after the play before it in the text"
            )));
        }
        starts.push(at);
    }
    // Hamlet opens the text: whatever precedes its title (nothing) belongs to it.
    starts[0] = 0;
    let ends = starts.iter().skip(1).copied().chain([bytes.len()]);
    Ok(starts.iter().zip(ends).map(|(&s, e)| s..e).collect())
}

/// The index into [`PLAYS`] of a play given by its number (1 to 6, the text's order) or its name
/// (case-insensitive; any unambiguous start, e.g. `macbeth`, `romeo`, `tempest`).
pub fn play_index(spec: &str) -> Option<usize> {
    if let Ok(n) = spec.trim().parse::<usize>() {
        return (1..=PLAYS.len()).contains(&n).then(|| n - 1);
    }
    let spec = spec.trim().to_lowercase();
    let hits: Vec<usize> = PLAYS
        .iter()
        .enumerate()
        .filter(|(_, (name, _))| {
            let name = name.to_lowercase();
            !spec.is_empty()
                && (name.starts_with(&spec) || name.trim_start_matches("the ").starts_with(&spec))
        })
        .map(|(i, _)| i)
        .collect();
    (hits.len() == 1).then(|| hits[0])
}

/// [`play_index`], or an error that lists the plays.
pub fn play_from(spec: &str) -> Result<usize> {
    play_index(spec).ok_or_else(|| {
        let names: Vec<String> = PLAYS
            .iter()
            .enumerate()
            .map(|(i, (name, _))| format!("{} {name}", i + 1))
            .collect();
        candle_core::Error::Msg(format!(
            "no play {spec:?} (a number or an unambiguous name); the plays: {}",
            names.join(", ")
        ))
    })
}

/// The embedded text and the byte range of play `play` (an index into [`PLAYS`]) in it.
fn play_bytes(play: usize) -> Result<(Vec<u8>, std::ops::Range<usize>)> {
    let bytes = gunzip(SHAKESPEARE_GZ)?;
    let ranges = play_ranges(&bytes)?;
    let range = ranges.get(play).cloned().ok_or_else(|| {
        candle_core::Error::Msg(format!("there are {} plays; no play {play}", PLAYS.len()))
    })?;
    Ok((bytes, range))
}

/// The six plays with one held out: the other five train (in the text's order), play `play` (an
/// index into [`PLAYS`]) validates. Its name is `shakespeare, <play> held out`.
pub fn shakespeare_held_out(play: usize) -> Result<Text> {
    let (bytes, range) = play_bytes(play)?;
    Text::held_out(
        &format!("shakespeare, {} held out", PLAYS[play].0),
        &bytes,
        range,
        64,
    )
}

/// One of the six plays alone (`play`, an index into [`PLAYS`]) with the fixed split of
/// [`shakespeare`]: the play's first 90% trains, its last 10% validates. Its name is
/// `<play> alone`. The bytes are those a file holding the play would have (the range
/// [`play_ranges`] gives), so `--text` on such a file trains the same model.
pub fn shakespeare_play(play: usize) -> Result<Text> {
    let (bytes, range) = play_bytes(play)?;
    Text::from_bytes(&format!("{} alone", PLAYS[play].0), &bytes[range], 64)
}

/// Loads a text file (gunzipped if its name ends in `.gz`) as bytes with the same split as
/// [`shakespeare`]: the first 90% train, the last 10% validate. `context` is the model's context,
/// for the length check.
pub fn text_file(path: &std::path::Path, context: usize) -> Result<Text> {
    let raw = std::fs::read(path)
        .map_err(|e| candle_core::Error::Msg(format!("cannot read {}: {e}", path.display())))?;
    let bytes = if path.extension().is_some_and(|e| e == "gz") {
        gunzip(&raw)?
    } else {
        raw
    };
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Text::from_bytes(&name, &bytes, context)
}
