//! The helpers transformers installs in its chat-template environment, with Python's output:
//! `raise_exception(msg)`, `strftime_now(fmt)` and the `tojson` filter (`json.dumps` with
//! `ensure_ascii=False` unless asked, `", "` / `": "` separators, `indent`, `sort_keys`).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// `raise_exception(message)`: fails the render with the template's own message.
pub fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: now, formatted like Python's `datetime.now().strftime` (in UTC;
/// transformers uses the server's local time zone).
pub fn strftime_now(format: String) -> String {
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, now_s)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

fn is_leap(year: u64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn month_days(year: u64, month: usize) -> u64 {
    const DAYS: [u64; 12] = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    DAYS[month] + u64::from(month == 1 && is_leap(year))
}

/// `unix_s` (UTC) formatted with the C/Python directives `%Y %y %m %d %e %H %I %M %S %p %b %h
/// %B %a %A %j %%`, and glibc's `%-d`-style unpadded forms; others are kept as written.
pub fn strftime(format: &str, unix_s: u64) -> String {
    let mut days = unix_s / 86_400;
    let weekday = ((days + 4) % 7) as usize; // 1970-01-01 was a Thursday
    let mut year = 1970;
    while days >= 365 + u64::from(is_leap(year)) {
        days -= 365 + u64::from(is_leap(year));
        year += 1;
    }
    let day_of_year = days + 1;
    let mut month = 0;
    while days >= month_days(year, month) {
        days -= month_days(year, month);
        month += 1;
    }
    let day = days + 1;
    let secs = unix_s % 86_400;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |out: &mut String, n: u64, width: usize| {
            let _ = if unpadded {
                write!(out, "{n}")
            } else {
                write!(out, "{n:0width$}")
            };
        };
        match spec {
            Some('Y') => num(&mut out, year, 4),
            Some('y') => num(&mut out, year % 100, 2),
            Some('m') => num(&mut out, month as u64 + 1, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = write!(out, "{day:>2}");
            }
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('j') => num(&mut out, day_of_year, 3),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[month]),
            Some('b' | 'h') => out.push_str(&MONTHS[month][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// The `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` with those keyword arguments honoured.
pub fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    // Python's defaults: ", " between items ("," when indenting) and ": " after keys.
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut dumper = Dumper {
        out: String::new(),
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    dumper.value(&value, 0)?;
    Ok(Value::from_safe_string(dumper.out))
}

struct Dumper {
    out: String,
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl Dumper {
    fn value(&mut self, v: &Value, level: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.number(v),
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', level, items.len(), |d, i, level| {
                    d.value(&items[i], level)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                self.container('{', '}', level, keys.len(), |d, i, level| {
                    d.string(&keys[i].to_string());
                    let sep = d.key_sep.clone();
                    d.out.push_str(&sep);
                    d.value(&v.get_item(&keys[i])?, level)
                })?;
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {} is not JSON serializable", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn container(
        &mut self,
        open: char,
        close: char,
        level: usize,
        len: usize,
        mut item: impl FnMut(&mut Dumper, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(level + 1);
            item(self, i, level + 1)?;
        }
        self.newline(level);
        self.out.push(close);
        Ok(())
    }

    fn newline(&mut self, level: usize) {
        if let Some(width) = self.indent {
            self.out.push('\n');
            self.out.extend(std::iter::repeat_n(' ', width * level));
        }
    }

    fn number(&mut self, v: &Value) {
        if v.is_integer() {
            let _ = write!(self.out, "{v}");
            return;
        }
        let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
        if f.is_nan() {
            self.out.push_str("NaN");
        } else if f.is_infinite() {
            self.out
                .push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        } else if f.fract() == 0.0 && f.abs() < 1e16 {
            let _ = write!(self.out, "{f:.1}");
        } else {
            // Rust's shortest round-trip digits; Python writes the exponent with a sign.
            let repr = format!("{f:?}");
            match repr.split_once('e') {
                Some((m, e)) if !e.starts_with('-') => {
                    let _ = write!(self.out, "{m}e+{e}");
                }
                _ => self.out.push_str(&repr),
            }
        }
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_like_python() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        let cases = [
            ("%d %b %Y", "29 Feb 2024"),
            ("%Y-%m-%d %H:%M:%S", "2024-02-29 13:05:09"),
            (
                "%A %a %B %j %y %I%p %%",
                "Thursday Thu February 060 24 01PM %",
            ),
            ("%-d %B, %-m %e", "29 February, 2 29"),
            ("%Q", "%Q"),
        ];
        for (format, expected) in cases {
            assert_eq!(strftime(format, t), expected, "{format}");
        }
        assert_eq!(strftime("%d %b %Y %A", 0), "01 Jan 1970 Thursday");
        assert_eq!(
            strftime("%d %m %Y", 951_782_400),
            "29 02 2000",
            "a century leap year"
        );
        assert_eq!(strftime("%j", 1_735_603_200), "366", "2024-12-31");
    }

    fn dumps(source: &str) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(source, ()).unwrap()
    }

    #[test]
    fn tojson_like_json_dumps() {
        let cases = [
            (
                r#"{{ {"b": [1, 2.5, none, true], "a": "é\"\n"} | tojson }}"#,
                // Insertion order, as Python's dicts keep it.
                r#"{"b": [1, 2.5, null, true], "a": "é\"\n"}"#,
            ),
            ("{{ [] | tojson }}{{ {} | tojson(indent=2) }}", "[]{}"),
            (
                "{{ [1, [2]] | tojson(indent=2) }}",
                "[\n  1,\n  [\n    2\n  ]\n]",
            ),
            (
                r#"{{ "é😀" | tojson(ensure_ascii=true) }}"#,
                r#""\u00e9\ud83d\ude00""#,
            ),
            (r#"{{ [1, 2] | tojson(separators=[",", ":"]) }}"#, "[1,2]"),
            ("{{ 3.0 | tojson }} {{ 1e30 | tojson }}", "3.0 1e+30"),
        ];
        for (source, expected) in cases {
            assert_eq!(dumps(source), expected, "{source}");
        }
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let mut env = minijinja::Environment::new();
        env.add_function("raise_exception", raise_exception);
        let err = env
            .render_str("{{ raise_exception('roles must alternate') }}", ())
            .unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }
}
