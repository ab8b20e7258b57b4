//! Whether a JSON schema accepts any finite document: llguidance compiles a schema whose
//! `$ref`s recurse through required properties (`{"type": "object", "properties": {"a":
//! {"$ref": "#"}}, "required": ["a"]}`) into a grammar that allows a next token forever, so
//! the model would write until `max_tokens` and return no JSON. [`Finite::accepts_some`]
//! finds such schemas before a request is queued.

use serde_json::Value;

/// Most schema nodes [`Finite::accepts_some`] visits: a few times the largest schema's nodes.
/// Past it the check gives up and lets the schema through (its output is still bounded by
/// `max_tokens`).
const MAX_FINITE_VISITS: usize = 1 << 20;

/// Whether a schema accepts some finite document, as far as a cheap, conservative reading
/// tells: a `$ref` target counts as finite once one of its ways out is (the least fixed
/// point, found by re-reading the targets until nothing changes). Only a schema whose every
/// way leads back through a required property or an array's minimum items is refused; a
/// type list, a missing `type` or anything not understood counts as a way out, so a schema
/// llguidance accepts is never refused for a misreading.
pub(super) struct Finite<'s> {
    /// `$ref`s met, and whether each is known to accept a finite document.
    refs: std::collections::HashMap<&'s str, bool>,
    visits: usize,
}

impl<'s> Finite<'s> {
    /// Whether the schema `root` accepts some finite document (`true` when unsure).
    pub(super) fn accepts_some(root: &'s Value) -> bool {
        Finite::check(root).0
    }

    /// [`Finite::accepts_some`]'s answer and the nodes it visited to find it.
    fn check(root: &'s Value) -> (bool, usize) {
        let mut f = Finite {
            refs: std::collections::HashMap::new(),
            visits: 0,
        };
        loop {
            if f.node(root) {
                return (true, f.visits);
            }
            let (known, before) = (f.refs.values().filter(|&&ok| ok).count(), f.refs.len());
            let open: Vec<&'s str> = f
                .refs
                .iter()
                .filter(|(_, ok)| !**ok)
                .map(|(r, _)| *r)
                .collect();
            for r in open {
                // A target llguidance would not find is its error to report, not this check's.
                let ok = resolve(root, r).is_none_or(|target| f.node(target));
                f.refs.insert(r, ok);
            }
            // Nothing newly finite and no new `$ref` met: the fixed point.
            if f.refs.values().filter(|&&ok| ok).count() == known && f.refs.len() == before {
                return (false, f.visits);
            }
        }
    }

    /// Whether `v` accepts a finite document, given what is known of the `$ref`s.
    fn node(&mut self, v: &'s Value) -> bool {
        self.visits += 1;
        if self.visits > MAX_FINITE_VISITS {
            return true;
        }
        let Value::Object(o) = v else {
            return *v != Value::Bool(false);
        };
        if o.contains_key("const") || o.contains_key("enum") {
            return true;
        }
        if let Some(Value::String(r)) = o.get("$ref") {
            if !*self.refs.entry(r.as_str()).or_insert(false) {
                return false;
            }
        }
        if let Some(Value::Array(all)) = o.get("allOf") {
            if !all.iter().all(|s| self.node(s)) {
                return false;
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(any)) = o.get(key) {
                if !any.is_empty() && !any.iter().any(|s| self.node(s)) {
                    return false;
                }
            }
        }
        match o.get("type").and_then(Value::as_str) {
            Some("object") => self.object(o),
            Some("array") => self.array(o),
            _ => true,
        }
    }

    /// An object is finite when every required property's schema is.
    fn object(&mut self, o: &'s serde_json::Map<String, Value>) -> bool {
        let Some(Value::Array(required)) = o.get("required") else {
            return true;
        };
        let properties = o.get("properties").and_then(Value::as_object);
        let extra = o.get("additionalProperties");
        required.iter().filter_map(Value::as_str).all(|name| {
            match properties.and_then(|p| p.get(name)).or(extra) {
                Some(schema) => self.node(schema),
                None => true,
            }
        })
    }

    /// An array is finite when the items its minimum length requires are.
    fn array(&mut self, o: &'s serde_json::Map<String, Value>) -> bool {
        let min = o.get("minItems").and_then(Value::as_u64).unwrap_or(0);
        let min = usize::try_from(min).unwrap_or(usize::MAX);
        let prefix = o.get("prefixItems").and_then(Value::as_array);
        let prefix = prefix.map_or(&[][..], Vec::as_slice);
        if !prefix.iter().take(min).all(|s| self.node(s)) {
            return false;
        }
        match o.get("items") {
            Some(items @ Value::Object(_)) if min > prefix.len() => self.node(items),
            _ => true,
        }
    }
}

/// The schema a local `$ref` (`#`, `#/$defs/name`) points at.
fn resolve<'s>(root: &'s Value, r: &str) -> Option<&'s Value> {
    let pointer = r.strip_prefix('#')?;
    if pointer.is_empty() {
        Some(root)
    } else {
        root.pointer(pointer)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn only_recursion_without_a_way_out_is_infinite() {
        let object = |props: Value, required: Value| json!({"type": "object", "properties": props, "required": required});
        let infinite = [
            json!({"$ref": "#"}),
            json!({"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}),
            json!({"allOf": [{"type": "string"}, {"$ref": "#"}]}),
            object(json!({"a": {"$ref": "#"}}), json!(["a"])),
            json!({"type": "array", "items": {"$ref": "#"}, "minItems": 2}),
            json!({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}),
            json!({"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["z"]}),
            json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
                   "$ref": "#/$defs/a"}),
            json!({"type": "object", "properties": {"a": false}, "required": ["a"]}),
        ];
        for schema in infinite {
            assert!(!Finite::accepts_some(&schema), "{schema}");
        }
        let finite = [
            json!({"type": "object"}),
            object(json!({"a": {"$ref": "#"}}), json!([])),
            object(
                json!({"a": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}}),
                json!(["a"]),
            ),
            json!({"type": "array", "items": {"$ref": "#"}}),
            json!({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}},
                   "required": ["a"]}),
            json!({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            json!({"$ref": "#/$defs/missing"}),
            json!({"$ref": "#", "enum": [1]}),
            // A chain of definitions, each finite only once the next is known to be: found
            // however the targets are ordered.
            json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"},
                             "c": {"type": "integer"}},
                   "$ref": "#/$defs/a"}),
        ];
        for schema in finite {
            assert!(Finite::accepts_some(&schema), "{schema}");
        }
    }

    #[test]
    fn a_schema_too_large_to_check_is_let_through() {
        // A long chain of definitions that ends nowhere: the check gives up at its budget.
        let defs: serde_json::Map<String, Value> = (0..50_000)
            .map(|i| {
                (
                    format!("d{i}"),
                    json!({"allOf": [{"$ref": format!("#/$defs/d{}", i + 1)}, {"$ref": "#"}]}),
                )
            })
            .collect();
        let schema = json!({"$defs": defs, "$ref": "#/$defs/d0"});
        let (accepted, visits) = Finite::check(&schema);
        assert!(accepted, "a check that gave up lets the schema through");
        // Past the budget every node answers at once: one more visit per open `$ref` at most.
        assert!(visits <= MAX_FINITE_VISITS + 2 * 50_001, "{visits} visits");
    }
}
