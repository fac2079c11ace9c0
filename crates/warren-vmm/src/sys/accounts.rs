//! The host's accounts as the system's user database enumerates them (`getpwent`, which
//! `nix` does not wrap: it is not reentrant, so one caller at a time enumerates here).

/// The longest enumeration: past it the answer is "unknown".
const MAX_ACCOUNTS: usize = 1_000_000;

/// The uids of every account whose primary group is `group`; `None` when the enumeration
/// was cut off (more than `MAX_ACCOUNTS` accounts).
pub fn primary_members(group: u32) -> Option<Vec<u32>> {
    // `getpwent` keeps one enumeration per process: one caller at a time.
    static ENUMERATION: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ENUMERATION.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = Vec::new();
    let mut complete = false;
    // SAFETY: `setpwent`, `getpwent` and `endpwent` are called under the lock above (the
    // only user of the enumeration in this process); each entry is read before the next
    // call, which may reuse its storage, and a null entry ends the loop.
    unsafe {
        libc::setpwent();
        for _ in 0..MAX_ACCOUNTS {
            let pw = libc::getpwent();
            if pw.is_null() {
                complete = true;
                break;
            }
            if (*pw).pw_gid == group {
                out.push((*pw).pw_uid);
            }
        }
        libc::endpwent();
    }
    complete.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root's primary group holds root (every system has it); a group no account has as
    /// its primary group holds nobody.
    #[test]
    fn test_primary_members() {
        assert!(primary_members(0).is_some_and(|m| m.contains(&0)));
        assert_eq!(primary_members(4_000_000), Some(vec![]));
    }
}
