//! A session's two configurations (session and runtime: string keys to serialized values),
//! published together as one generation, so a reader never sees a new session configuration
//! paired with an old runtime one.

use std::collections::BTreeMap;

use crate::error::{OrtexError, Result};

/// A session or runtime configuration. Ordered, so that the same configuration always serializes
/// and iterates the same way.
pub type ConfigMap = BTreeMap<String, String>;

/// The most entries a session or runtime configuration may hold.
pub const MAX_CONFIG_ENTRIES: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SessionConfigs {
    session: ConfigMap,
    runtime: ConfigMap,
    generation: u64,
}

impl SessionConfigs {
    pub fn session(&self) -> &ConfigMap {
        &self.session
    }

    pub fn runtime(&self) -> &ConfigMap {
        &self.runtime
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Publishes new configurations as one generation; with neither given nothing changes.
    /// Returns the generation in effect afterwards. Changes nothing when it fails.
    pub fn replace(&mut self, session: Option<ConfigMap>, runtime: Option<ConfigMap>) -> Result<u64> {
        if session.is_none() && runtime.is_none() {
            return Ok(self.generation);
        }
        for config in [&session, &runtime].into_iter().flatten() {
            if config.len() > MAX_CONFIG_ENTRIES {
                return Err(OrtexError::invalid(format!("a config may hold at most {MAX_CONFIG_ENTRIES} entries")));
            }
        }
        let generation =
            self.generation.checked_add(1).ok_or_else(|| OrtexError::invalid("config generation is exhausted"))?;
        if let Some(config) = session {
            self.session = config;
        }
        if let Some(config) = runtime {
            self.runtime = config;
        }
        self.generation = generation;
        Ok(generation)
    }

    pub fn check_invariants(&self) {
        assert!(self.session.len() <= MAX_CONFIG_ENTRIES && self.runtime.len() <= MAX_CONFIG_ENTRIES);
    }
}
