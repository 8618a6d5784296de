//! Validation of client-supplied names that become path components:
//! session names, mount names and process ids. Anything that could walk out
//! of its directory (`..`, `/`, NUL, empty) is refused here, once, for both
//! the helper and the agent.

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("{what} must not be empty")]
    Empty { what: &'static str },
    #[error("{what} {name:?} is longer than {max} bytes")]
    TooLong {
        what: &'static str,
        name: String,
        max: usize,
    },
    #[error("{what} {name:?} contains a forbidden character or path component (no '/', '..', '.', NUL or control characters)")]
    Forbidden { what: &'static str, name: String },
}

/// Longest single path component Linux accepts.
const MAX_COMPONENT: usize = 255;

/// Longest nested mount name we accept.
const MAX_MOUNT_NAME: usize = 1024;

fn check_component(what: &'static str, name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { what });
    }
    if name.len() > MAX_COMPONENT {
        return Err(NameError::TooLong {
            what,
            name: name.to_string(),
            max: MAX_COMPONENT,
        });
    }
    if name == "." || name == ".." || name.contains('/') || name.chars().any(|c| c.is_control()) {
        return Err(NameError::Forbidden {
            what,
            name: name.to_string(),
        });
    }
    Ok(())
}

/// A session name: one safe path component.
pub fn session_name(name: &str) -> Result<(), NameError> {
    check_component("session name", name)
}

/// A mount name: one or more safe components joined by `/` (`.claude/skills`).
pub fn mount_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { what: "mount name" });
    }
    if name.len() > MAX_MOUNT_NAME {
        return Err(NameError::TooLong {
            what: "mount name",
            name: name.to_string(),
            max: MAX_MOUNT_NAME,
        });
    }
    if name.starts_with('/') || name.ends_with('/') {
        return Err(NameError::Forbidden {
            what: "mount name",
            name: name.to_string(),
        });
    }
    for part in name.split('/') {
        check_component("mount name", part).map_err(|_| NameError::Forbidden {
            what: "mount name",
            name: name.to_string(),
        })?;
    }
    Ok(())
}

/// A host path relative to `/` as the client sends it (`home/u/project`);
/// a leading `/` is tolerated. Returns the normalized relative form.
pub fn host_relative_path(path: &str) -> Result<String, NameError> {
    let trimmed = path.trim_start_matches('/');
    if trimmed.is_empty() {
        // The whole host root is never shared.
        return Err(NameError::Forbidden {
            what: "host path",
            name: path.to_string(),
        });
    }
    let mut parts = Vec::new();
    for part in trimmed.split('/') {
        match part {
            "" | "." => continue,
            ".." => {
                return Err(NameError::Forbidden {
                    what: "host path",
                    name: path.to_string(),
                })
            }
            p if p.contains('\0') => {
                return Err(NameError::Forbidden {
                    what: "host path",
                    name: path.to_string(),
                })
            }
            p => parts.push(p),
        }
    }
    if parts.is_empty() {
        return Err(NameError::Forbidden {
            what: "host path",
            name: path.to_string(),
        });
    }
    Ok(parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_names() {
        assert!(session_name("brave-fox-123").is_ok());
        assert!(session_name(".hidden").is_ok());
        for bad in ["", ".", "..", "a/b", "../x", "a\0b", "a\nb"] {
            assert!(session_name(bad).is_err(), "{bad:?}");
        }
        assert!(session_name(&"x".repeat(256)).is_err());
    }

    #[test]
    fn mount_names() {
        assert!(mount_name("outputs").is_ok());
        assert!(mount_name(".claude/skills").is_ok());
        for bad in ["", "/abs", "a/", "a//b", "a/../b", "..", "./a"] {
            assert!(mount_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn host_paths() {
        assert_eq!(host_relative_path("home/u/p").unwrap(), "home/u/p");
        assert_eq!(host_relative_path("/home//u/./p/").unwrap(), "home/u/p");
        for bad in ["", "/", "home/../etc", "..", "./"] {
            assert!(host_relative_path(bad).is_err(), "{bad:?}");
        }
    }
}
