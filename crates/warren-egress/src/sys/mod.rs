//! OS specifics: network namespaces, the redirected socket's original destination, and the
//! credential drop of interception commands. No `unsafe` is needed (nix and std wrap it).

pub(crate) mod netns;
pub(crate) mod process;
pub(crate) mod sockopt;
