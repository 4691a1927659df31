//! Hugging Face chat templates rendered with minijinja.
//!
//! Chosen because minijinja is the Jinja engine Rust servers use for these templates
//! (text-generation-inference, mistral.rs): it runs Jinja2 syntax directly, and with
//! `minijinja-contrib`'s `pycompat` the Python methods templates call on strings, dicts and
//! lists (`.strip()`, `.split()`, `.items()`, `.get()`). What Hugging Face's `transformers`
//! adds is added here the same way: `trim_blocks` and `lstrip_blocks`, `raise_exception`,
//! `strftime_now`, and a `tojson` that is Python's `json.dumps(ensure_ascii=False)`; printed
//! `None`, `True` and `False` are spelled as Python spells them. `scripts/render-templates.py`
//! renders the same templates with Python's `jinja2` the way `transformers` does, and the
//! tests compare the two byte for byte.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use super::pyjson::Dumps;

const NAME: &str = "chat";

/// A compiled chat template.
pub struct Template {
    env: Environment<'static>,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Template").finish_non_exhaustive()
    }
}

impl Template {
    /// Compiles `source` (a syntax error is returned with its line).
    pub fn new(source: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| describe(&e))?;
        Ok(Self { env })
    }

    /// Renders the template with `ctx` (the template's variables).
    pub fn render(&self, ctx: &serde_json::Value) -> Result<String, String> {
        let t = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        // Maps keep their order (minijinja's `preserve_order`).
        t.render(Value::from(minijinja::value::Serde(ctx)))
            .map_err(|e| describe(&e))
    }
}

/// An error's message with its template line, for logs and API errors.
fn describe(e: &Error) -> String {
    let mut msg = match e.kind() {
        // The template's own words (`raise_exception("...")`).
        ErrorKind::InvalidOperation => e.detail().unwrap_or("error").to_owned(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        if !msg.contains("line") {
            msg.push_str(&format!(" (chat template line {line})"));
        }
    }
    msg
}

/// `raise_exception(message)`: templates refuse conversations they cannot render.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time, formatted as Python's `strftime` does.
fn strftime_now(format: String) -> String {
    chrono::Local::now().format(&format).to_string()
}

/// `x | tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let mut d = Dumps::default();
    if let Some(a) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        d.ensure_ascii = a;
    }
    d.indent = kwargs.get::<Option<usize>>("indent")?;
    if let Some(s) = kwargs.get::<Option<Vec<String>>>("separators")? {
        match <[String; 2]>::try_from(s) {
            Ok([item, key]) => d.separators = Some((item, key)),
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be two strings",
                ))
            }
        }
    }
    if let Some(s) = kwargs.get::<Option<bool>>("sort_keys")? {
        d.sort_keys = s;
    }
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from(d.dumps(&json)))
}

/// Prints values as Python's `str()` does where minijinja differs: `None`, `True`, `False`.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut minijinja::State,
    value: &Value,
) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, ctx: serde_json::Value) -> Result<String, String> {
        Template::new(src)?.render(&ctx)
    }

    #[test]
    fn blocks_trim_their_newline_and_leading_space() {
        let src = "{% for m in messages %}\n  {% if m %}\n{{ m }}\n  {% endif %}\n{% endfor %}";
        assert_eq!(
            render(src, json!({"messages": ["a", "b"]})).unwrap(),
            "a\nb\n"
        );
    }

    #[test]
    fn python_string_and_dict_methods_work() {
        let src = "{{ s.strip().split(',')[-1] }}|{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}|{{ d.get('x', 'none') }}";
        assert_eq!(
            render(src, json!({"s": " a,b ", "d": {"z": 1, "a": 2}})).unwrap(),
            "b|z=1a=2|none"
        );
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let src = "{{ t | tojson }}|{{ t | tojson(indent=2) }}";
        assert_eq!(
            render(src, json!({"t": {"b": "<é>", "a": [1.0]}})).unwrap(),
            "{\"b\": \"<é>\", \"a\": [1.0]}|{\n  \"b\": \"<é>\",\n  \"a\": [\n    1.0\n  ]\n}"
        );
    }

    #[test]
    fn raise_exception_fails_with_the_templates_message() {
        let e = render(
            "{{ raise_exception('Only user and assistant roles') }}",
            json!({}),
        )
        .unwrap_err();
        assert!(e.starts_with("Only user and assistant roles"), "{e}");
    }

    #[test]
    fn none_and_booleans_print_as_python_does() {
        assert_eq!(
            render(
                "{{ a }} {{ b }} {{ c }}",
                json!({"a": null, "b": true, "c": false})
            )
            .unwrap(),
            "None True False"
        );
    }

    #[test]
    fn loop_controls_and_namespaces_work() {
        let src = "{% set ns = namespace(n=0) %}{% for x in xs %}{% if x > 2 %}{% break %}{% endif %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}";
        assert_eq!(render(src, json!({"xs": [1, 2, 3, 4]})).unwrap(), "3");
    }

    #[test]
    fn a_syntax_error_names_its_line() {
        let e = Template::new("ok\n{% if %}").unwrap_err();
        assert!(e.contains("line 2"), "{e}");
    }
}
