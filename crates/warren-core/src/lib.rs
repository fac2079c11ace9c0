//! warren-core
