//! The OpenAPI 3.1 document of the HTTP API, generated from the same schemas MCP discovery
//! advertises. Each tool's schema definitions are hoisted into `components/schemas`.

use serde_json::{json, Map, Value};

use crate::service::ToolDef;

/// Rewrites `#/$defs/X` references to `#/components/schemas/X`, moving definitions into
/// `defs` and dropping per-schema `$schema` keys.
fn hoist(mut schema: Map<String, Value>, defs: &mut Map<String, Value>) -> Value {
    schema.remove("$schema");
    if let Some(Value::Object(d)) = schema.remove("$defs") {
        for (k, v) in d {
            let v = match v {
                Value::Object(m) => hoist(m, defs),
                other => other,
            };
            defs.insert(k, v);
        }
    }
    let mut v = Value::Object(schema);
    rewrite_refs(&mut v);
    v
}

fn rewrite_refs(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if k == "$ref" {
                    if let Value::String(s) = x {
                        if let Some(name) = s.strip_prefix("#/$defs/") {
                            *s = format!("#/components/schemas/{name}");
                        }
                    }
                } else {
                    rewrite_refs(x);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(rewrite_refs),
        _ => {}
    }
}

/// The document for `tools`.
pub fn document(tools: &[ToolDef]) -> Value {
    let mut defs = Map::new();
    defs.insert(
        "Error".into(),
        json!({
            "type": "object",
            "required": ["error"],
            "properties": {"error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {
                    "code": {"type": "string", "enum": crate::error::CODES},
                    "message": {"type": "string"}
                }
            }}
        }),
    );
    let mut paths = Map::new();
    for t in tools {
        let input = hoist(t.input_schema.clone(), &mut defs);
        let output = hoist(t.output_schema.clone(), &mut defs);
        let err = json!({"description": "Refused; `error.code` is stable.",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
        paths.insert(
            format!("/v1/tools/{}", t.name),
            json!({"post": {
                "operationId": t.name,
                "summary": t.description,
                "requestBody": {"required": true,
                    "content": {"application/json": {"schema": input}}},
                "responses": {
                    "200": {"description": "The tool's result.",
                        "content": {"application/json": {"schema": output}}},
                    "4XX": err.clone(),
                    "5XX": err,
                }
            }}),
        );
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Warren",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Private Linux workspaces in microVMs. Every tool is also an MCP tool at /mcp."
        },
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": defs,
        }
    })
}

/// A standalone JSON Schema for the response of `tool` with HTTP status class `status`
/// (`"200"`, `"4XX"`, `"5XX"`): the operation's schema with the document's components
/// attached, so its references resolve. Used to check responses against the document.
pub fn response_schema(doc: &Value, tool: &str, status: &str) -> Option<Value> {
    let path = format!("/v1/tools/{tool}");
    let s = doc.get("paths")?.get(&path)?.pointer(&format!(
        "/post/responses/{status}/content/application~1json/schema"
    ))?;
    let mut s = s.clone();
    let obj = s.as_object_mut()?;
    obj.insert("components".into(), doc.get("components")?.clone());
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_document_matches_committed_copy() {
        let doc = document(&crate::service::tool_defs(&[
            "dev".into(),
            "minimal".into(),
        ]));
        let text = serde_json::to_string_pretty(&doc).expect("encode") + "\n";
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
        if std::env::var_os("WARREN_UPDATE_SNAPSHOT").is_some() {
            std::fs::write(path, &text).expect("write");
        }
        let have = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            have == text,
            "docs/openapi.json is stale: rerun with WARREN_UPDATE_SNAPSHOT=1"
        );
        assert!(!text.contains("$defs"), "unhoisted definitions");
    }

    #[test]
    fn test_response_schemas_validate_examples() {
        let doc = document(&crate::service::tool_defs(&["dev".into()]));
        let err = response_schema(&doc, "vm_list", "4XX").expect("schema");
        let v = jsonschema::validator_for(&err).expect("compile");
        assert!(v.is_valid(&json!({"error": {"code": "forbidden", "message": "m"}})));
        assert!(!v.is_valid(&json!({"error": {"code": "made_up", "message": "m"}})));
        let ok = response_schema(&doc, "vm_list", "200").expect("schema");
        let v = jsonschema::validator_for(&ok).expect("compile");
        assert!(v.is_valid(&json!({"vms": []})));
        assert!(!v.is_valid(&json!({"vms": [{"vm_id": 3}]})));
    }
}
