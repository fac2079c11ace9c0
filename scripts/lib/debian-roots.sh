# Sourced by scripts/test-debs and scripts/build-oci: a Debian root with systemd and the
# warren package's dependencies installed, made once with debootstrap and kept as a tarball
# in $WARREN_ROOT_CACHE, keyed by suite, mirror and dependency list.
#
#   root_tarball SUITE WARREN_DEB WORKDIR   prints the tarball's path
#
#   WARREN_ROOT_CACHE     where the tarballs live (default /var/cache/warren/roots)
#   WARREN_DEBIAN_MIRROR  the Debian mirror (default http://deb.debian.org/debian)
#   WARREN_DEBIAN_SECURITY_MIRROR  its security archive (default
#                         http://deb.debian.org/debian-security)
#
# The root's apt sources hold the suite, its -updates and its -security archives, and the
# root is upgraded when it is made; what ships from it (scripts/build-oci) upgrades it again.

root_tarball() {
  local suite=$1 deb=$2 work=$3
  local cache="${WARREN_ROOT_CACHE:-/var/cache/warren/roots}"
  local mirror="${WARREN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  local security="${WARREN_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
  # Package names of the dependencies (alternatives and versions dropped).
  local deps
  deps=$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | sed 's/[|(].*//; s/ //g' | grep -v '^$' | sort -u)
  local key tarball dir
  key=$(printf '%s\n' v2 "$suite" "$mirror" "$security" $deps | sha256sum | cut -c1-16)
  tarball="$cache/root-$suite-$key.tar.zst"
  mkdir -p "$cache"
  if [ -f "$tarball" ]; then
    echo "$tarball"
    return 0
  fi
  dir="$work/mk-$suite"
  echo "debian-roots: debootstrap $suite, then the dependencies (kept as $tarball)" >&2
  debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,ca-certificates \
    "$suite" "$dir" "$mirror" >"$work/debootstrap-$suite.log" 2>&1 || {
    tail -20 "$work/debootstrap-$suite.log" >&2
    echo "debian-roots: debootstrap $suite failed" >&2
    return 1
  }
  printf 'deb %s %s-updates main\ndeb %s %s-security main\n' "$mirror" "$suite" "$security" "$suite" \
    >"$dir/etc/apt/sources.list.d/updates.list"
  local install="apt-get install -y -qq --no-install-recommends" pkgs
  pkgs=$(echo "$deps" | grep -v '^virtiofsd$' | tr '\n' ' ')
  if [ "$suite" = bookworm ]; then
    # QEMU >= 9 is in bookworm-backports; virtiofsd is Warren's own package there.
    echo "deb $mirror bookworm-backports main" >"$dir/etc/apt/sources.list.d/backports.list"
    install="$install -t bookworm-backports"
  else
    pkgs="$pkgs virtiofsd"
  fi
  systemd-nspawn -q -D "$dir" --register=no --keep-unit --console=pipe \
    env DEBIAN_FRONTEND=noninteractive sh -c "apt-get update -qq && apt-get dist-upgrade -y -qq && $install $pkgs" \
    >"$work/deps-$suite.log" 2>&1 || {
    tail -20 "$work/deps-$suite.log" >&2
    echo "debian-roots: installing the dependencies in $suite failed" >&2
    return 1
  }
  rm -f "$dir"/var/cache/apt/archives/*.deb
  tar -C "$dir" --numeric-owner -I 'zstd -T0 -3' -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$dir"
  echo "$tarball"
}
