//! warren-supervisor
