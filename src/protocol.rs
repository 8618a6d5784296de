//! The client protocol: request envelopes, replies, events and the typed
//! parameters of every method (PROTOCOL.md and CLIENT-NOTES.md).
//!
//! Parsing never panics: a frame that is not a JSON object, a missing or
//! non-string `method`, or a parameter of the wrong type becomes a
//! [`ProtocolError`] whose text names the offending field, and the server
//! answers it with `success:false`.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// Errors in a request as received.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("request is not valid JSON: {0}")]
    NotJson(String),
    #[error("request must be a JSON object, got {0}")]
    NotObject(&'static str),
    #[error("request has no string field \"method\"")]
    NoMethod,
    #[error("invalid params for {method}: {detail}")]
    Params { method: String, detail: String },
}

/// A parsed request envelope.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    /// Echoed exactly as sent; `None` when the request had no id.
    pub id: Option<Value>,
    pub params: Value,
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Request {
    /// Parses a frame body. On failure returns the id (if one could be read)
    /// with the error, so the reply can still be matched.
    pub fn parse(body: &[u8]) -> Result<Request, (Option<Value>, ProtocolError)> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| (None, ProtocolError::NotJson(e.to_string())))?;
        let Value::Object(mut obj) = value else {
            return Err((None, ProtocolError::NotObject(kind(&value))));
        };
        let id = obj.remove("id").filter(|v| !v.is_null());
        let method = match obj.remove("method") {
            Some(Value::String(m)) => m,
            _ => return Err((id, ProtocolError::NoMethod)),
        };
        let params = obj.remove("params").unwrap_or(Value::Null);
        Ok(Request { method, id, params })
    }

    /// Deserializes the params into `T`, naming the field path on error.
    /// Absent or null params count as `{}`.
    pub fn params<T: DeserializeOwned>(&self) -> Result<T, ProtocolError> {
        let value = match &self.params {
            Value::Null => Value::Object(Map::new()),
            v => v.clone(),
        };
        serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let detail = if path == "." {
                e.inner().to_string()
            } else {
                format!("field `{path}`: {}", e.inner())
            };
            ProtocolError::Params {
                method: self.method.clone(),
                detail,
            }
        })
    }
}

/// Builds a reply body. This is where a failed request's typed error
/// becomes the protocol's `error` string: its `Display`, which is one
/// sentence saying what failed and what to do (its causes included).
pub fn reply<E: std::fmt::Display>(id: Option<&Value>, outcome: Result<Value, E>) -> Vec<u8> {
    let mut obj = Map::new();
    match outcome {
        Ok(result) => {
            obj.insert("success".into(), Value::Bool(true));
            if !result.is_null() {
                obj.insert("result".into(), result);
            }
        }
        Err(error) => {
            obj.insert("success".into(), Value::Bool(false));
            obj.insert("error".into(), Value::String(error.to_string()));
        }
    }
    if let Some(id) = id {
        obj.insert("id".into(), id.clone());
    }
    serde_json::to_vec(&Value::Object(obj)).unwrap_or_default()
}

/// The error text for an unknown method. The client's disk janitor looks for
/// the lower-case form, other code paths for the capitalised one.
pub fn unknown_method(method: &str) -> String {
    format!("Unknown method: {method} (unknown method)")
}

/// Events sent on subscription connections.
pub mod event {
    use super::*;

    pub fn output(stream: &'static str, id: &str, data: &str) -> Value {
        json!({"type": stream, "id": id, "data": data})
    }

    pub fn exit(id: &str, code: Option<i32>, signal: Option<&str>, oom: Option<u64>) -> Value {
        let mut obj = Map::new();
        obj.insert("type".into(), "exit".into());
        obj.insert("id".into(), id.into());
        if let Some(c) = code {
            obj.insert("exitCode".into(), c.into());
        }
        if let Some(s) = signal {
            obj.insert("signal".into(), s.into());
        }
        if let Some(o) = oom {
            obj.insert("oomKillCount".into(), o.into());
        }
        Value::Object(obj)
    }

    pub fn error(id: &str, message: &str, fatal: bool) -> Value {
        json!({"type": "error", "id": id, "message": message, "fatal": fatal})
    }

    pub fn startup_step(step: &str, status: &str) -> Value {
        json!({"type": "startupStep", "step": step, "status": status})
    }

    pub fn network_status(status: &str) -> Value {
        json!({"type": "networkStatus", "status": status})
    }

    pub fn api_reachability(status: &str) -> Value {
        json!({"type": "apiReachability", "status": status})
    }

    pub fn guest_request(id: &str, method: &str, params: &Value) -> Value {
        json!({"type": "request", "id": id, "method": method, "params": params})
    }
}

/// Startup step names the client knows.
pub mod step {
    pub const VM_BOOT: &str = "vm_boot";
    pub const GUEST_CONNECT: &str = "guest_vsock_connect";
    pub const SDK_INSTALL: &str = "sdk_install";
}

// ---- parameters -------------------------------------------------------

/// `configure` and `subscribeEvents` profile identity.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProfileParams {
    #[serde(default)]
    pub user_data_name: Option<String>,
    #[serde(default)]
    pub user_data_root: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigureParams {
    #[serde(default)]
    pub user_data_name: Option<String>,
    #[serde(default)]
    pub user_data_root: Option<String>,
    #[serde(default, rename = "memoryMB")]
    pub memory_mb: Option<u64>,
    #[serde(default)]
    pub cpu_count: Option<u32>,
    #[serde(default)]
    pub session_only: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateVmParams {
    #[serde(default)]
    pub bundle_path: Option<String>,
    #[serde(default, rename = "diskSizeGB")]
    pub disk_size_gb: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartVmParams {
    #[serde(default)]
    pub bundle_path: Option<String>,
    #[serde(default, rename = "memoryGB")]
    pub memory_gb: Option<f64>,
    #[serde(default)]
    pub cpu_count: Option<u32>,
    #[serde(default, rename = "apiProbeURL")]
    pub api_probe_url: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct MountParam {
    pub path: String,
    #[serde(default = "default_mode")]
    pub mode: String,
}

fn default_mode() -> String {
    "ro".into()
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpawnParams {
    pub id: String,
    pub name: String,
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub is_resume: bool,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: Option<BTreeMap<String, Option<String>>>,
    #[serde(default)]
    pub additional_mounts: Option<BTreeMap<String, MountParam>>,
    #[serde(default)]
    pub allowed_domains: Option<Vec<String>>,
    #[serde(default)]
    pub one_shot: Option<bool>,
    #[serde(default)]
    pub mount_skeleton_home: Option<bool>,
    #[serde(default)]
    pub oauth_token: Option<String>,
}

/// `kill` accepts a signal name or number.
#[derive(Debug, Deserialize)]
pub struct KillParams {
    pub id: String,
    #[serde(default)]
    pub signal: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct WriteStdinParams {
    pub id: String,
    pub data: String,
}

#[derive(Debug, Deserialize)]
pub struct IdParams {
    pub id: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestResponseParams {
    pub id: Value,
    #[serde(default)]
    pub result_json: Option<String>,
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct DebugLoggingParams {
    pub enabled: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MountPathParams {
    pub process_id: String,
    pub subpath: String,
    pub mount_name: String,
    #[serde(default = "default_mode")]
    pub mode: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReadFileParams {
    pub process_name: String,
    pub file_path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskInfoParams {
    #[serde(default)]
    pub low_water_bytes: Option<u64>,
}

#[derive(Debug, Deserialize)]
pub struct DeleteSessionDirsParams {
    pub names: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PruneParams {
    #[serde(default)]
    pub only_if_free_bytes_below: Option<u64>,
    #[serde(default)]
    pub include_session_tmp: Option<bool>,
    #[serde(default)]
    pub session_tmp_older_than_seconds: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstallSdkParams {
    pub sdk_subpath: String,
    pub version: String,
}

#[derive(Deserialize)]
pub struct TokenParams {
    pub token: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_id_is_echoed_exactly() {
        let r = Request::parse(br#"{"method":"isRunning","id":7}"#).unwrap();
        assert_eq!(
            reply(
                r.id.as_ref(),
                Ok::<_, ProtocolError>(json!({"running": false}))
            ),
            br#"{"id":7,"result":{"running":false},"success":true}"#.to_vec()
        );
        let r = Request::parse(br#"{"method":"isRunning","id":"x"}"#).unwrap();
        let v: Value =
            serde_json::from_slice(&reply(r.id.as_ref(), Ok::<_, ProtocolError>(Value::Null)))
                .unwrap();
        assert_eq!(v, json!({"success": true, "id": "x"}));
        let r = Request::parse(br#"{"method":"isRunning"}"#).unwrap();
        let v: Value =
            serde_json::from_slice(&reply(r.id.as_ref(), Err(ProtocolError::NoMethod))).unwrap();
        assert_eq!(
            v,
            json!({"success": false, "error": "request has no string field \"method\""})
        );
    }

    #[test]
    fn bad_envelopes() {
        assert!(matches!(
            Request::parse(b"nope"),
            Err((None, ProtocolError::NotJson(_)))
        ));
        assert!(matches!(
            Request::parse(b"[1]"),
            Err((None, ProtocolError::NotObject("an array")))
        ));
        let (id, e) = Request::parse(br#"{"id":3,"method":5}"#).unwrap_err();
        assert_eq!(id, Some(json!(3)));
        assert!(matches!(e, ProtocolError::NoMethod));
    }

    #[test]
    fn wrong_param_type_names_the_field() {
        let r = Request::parse(
            br#"{"method":"spawn","params":{"id":"a","name":"s","command":"x","args":5}}"#,
        )
        .unwrap();
        let err = r.params::<SpawnParams>().err().unwrap().to_string();
        assert!(err.contains("spawn") && err.contains("args"), "{err}");
        let r = Request::parse(br#"{"method":"kill","params":{}}"#).unwrap();
        let err = r.params::<KillParams>().unwrap_err().to_string();
        assert!(err.contains("id"), "{err}");
    }

    #[test]
    fn unknown_method_has_both_spellings() {
        let t = unknown_method("frob");
        assert!(t.contains("Unknown method") && t.contains("unknown method"));
    }
}
