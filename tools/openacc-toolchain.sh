#!/bin/bash
# gcc 12 with nvptx offloading (OpenACC C and Fortran on NVIDIA GPUs) as one relocatable
# archive, for a machine that has neither gfortran nor offloading nor network (the GPU
# machine: Ubuntu 24.04, gcc 13.3). Debian bookworm's packages, unpacked with dpkg -x (no
# root, no clash with the machine's gcc), pruned to what compiling and offloading need:
#
#   tools/openacc-toolchain.sh OUT.tar.xz [DEBS]   # DEBS: a folder with the .debs (else apt-get download)
#
# XZ_LEVEL (default 6) trades time for size: 1 is several times faster and about 5 MiB
# larger (the tests make theirs at 6, the size that travels).
#
# The archive holds one folder, gcc12-openacc/, with usr/ (the compilers, found by gcc's own
# relocation: the driver looks for cc1, lto1 and mkoffload next to itself), env.sh (source
# it: CC, FC, PATH, LD_LIBRARY_PATH) and MANIFEST (each package and version, what was kept
# and dropped, sizes, and what is taken from the machine). The MANIFEST is also written next
# to OUT, with the archive's size.
#
# Taken from the machine, not carried: binutils (as, ld; nvptx-tools' ar and ranlib are
# links to them), glibc and its headers (libc6-dev), and the libraries gcc's compilers link
# (libisl23, libmpc3, libmpfr6, libgmp10, zlib1g, libzstd1, libstdc++6, libgcc-s1): the
# machine's own gcc 13 needs the same ones, at the same sonames, and its glibc (2.39) is
# newer than the 2.36 these binaries want. env.sh's check (ldd) says which is missing.
set -euo pipefail

# the packages, each with why; their dependencies above are the machine's
PACKAGES=(
    gcc-12-base          # gcc 12's shared files (one copyright, nothing run)
    cpp-12 gcc-12        # the C driver, cc1, lto1, lto-wrapper, collect2
    libgcc-12-dev        # crtbegin/end, libgcc, and libgomp.spec that -fopenacc reads
    gfortran-12          # the Fortran driver and f951
    libgfortran-12-dev   # libgfortran.spec and the link-time libgfortran.so
    libgfortran5 libquadmath0  # Fortran's runtime (the machine has no gfortran)
    libgomp1             # OpenACC's runtime: the one the plugin was built with (12.2)
    libgomp-plugin-nvptx1  # the runtime's way to the GPU (through the driver's libcuda)
    gcc-12-offload-nvptx # mkoffload, the nvptx compiler and the device's newlib, libgomp
    nvptx-tools          # nvptx-none-as and -ld, which mkoffload's compiler runs
)

out=$(realpath -m "$1")
debs=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/gcc12-openacc

if [ -z "$debs" ]; then
    debs=$work/debs
    mkdir -p "$debs"
    (cd "$debs" && apt-get download -q "${PACKAGES[@]}")
fi
mkdir -p "$prefix"
for package in "${PACKAGES[@]}"; do
    deb=$(ls "$debs/${package}"_*.deb)
    dpkg -x "$deb" "$prefix"
done

# what compiling, linking and offloading do not use: docs, man pages, lintian; the
# sanitizers, gcov, lto-dump and gcc's plugin API; static Fortran runtimes (moagen links
# shared); the device libraries' mgomp multilib, which only OpenMP offloading (-fopenmp,
# -foffload) links, and mptx-3.1 (-mptx=3.1, not sm_80's PTX); nvptx-tools' run tools
# (they run a program on a GPU alone); then links the removals left dangling
lib=$prefix/usr/lib/gcc/x86_64-linux-gnu/12
accel=$lib/accel/nvptx-none
rm -rf "$prefix/usr/share" "$lib/plugin" "$lib/lto1" "$accel/mgomp" "$accel/mptx-3.1"
rm -f "$prefix"/usr/bin/*lto-dump-12 "$prefix"/usr/bin/*gcov* "$prefix"/usr/bin/nvptx-none-run* \
    "$lib"/lib{a,l,t,ub}san* "$lib"/libgcov.a "$lib"/libitm* "$lib"/libgfortran.a \
    "$lib"/libquadmath.a "$lib"/libcaf_single.a "$lib"/libcc1.so "$lib"/libbacktrace.a \
    "$accel"/libgcov.a "$accel"/libcaf_single.a
find "$prefix" -xtype l -delete

# source it: the compilers on PATH and in CC / FC (moagen's toolchain reads them), their
# runtimes first on LD_LIBRARY_PATH (the nvptx plugin must load with the libgomp it was
# built with); it fails, saying what, where the machine lacks a library the compilers need
cat > "$prefix/env.sh" <<'EOF'
# gcc 12 with nvptx offloading, unpacked here (tools/openacc-toolchain.sh): source this file
_acc=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH=$_acc/usr/bin:$PATH
export CC=$_acc/usr/bin/gcc-12 FC=$_acc/usr/bin/gfortran-12
export LD_LIBRARY_PATH=$_acc/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
_missing=$(ldd "$_acc"/usr/lib/gcc/x86_64-linux-gnu/12/{cc1,f951} \
    "$_acc"/usr/lib/gcc/x86_64-linux-gnu/12/accel/nvptx-none/{lto1,mkoffload} \
    "$_acc"/usr/bin/nvptx-none-ld 2>&1 | grep -E 'not found|No such file' | sort -u)
if [ -n "$_missing" ]; then
    echo "gcc12-openacc: the machine lacks libraries its compilers need (or a file is gone):" >&2
    echo "$_missing" >&2
    return 1
fi
unset _acc _missing
EOF

{
    echo "gcc12-openacc: gcc 12 with nvptx offloading from Debian bookworm (tools/openacc-toolchain.sh)"
    echo "made $(date -u +%F) on $(. /etc/os-release && echo "$PRETTY_NAME")"
    echo
    echo "package version deb_bytes kept_bytes"
    for package in "${PACKAGES[@]}"; do
        deb=$(ls "$debs/${package}"_*.deb)
        kept=0
        while read -r path; do
            [ -f "$prefix/$path" ] && [ ! -L "$prefix/$path" ] &&
                kept=$((kept + $(stat -c %s "$prefix/$path")))
        done < <(dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\./||')
        echo "$package $(dpkg-deb -f "$deb" Version) $(stat -c %s "$deb") $kept"
    done
    echo
    echo "dropped: usr/share (docs, man, lintian); gcc's plugin API; sanitizers, gcov, itm,"
    echo "lto-dump; static libgfortran, libquadmath; the device libraries' mgomp (OpenMP"
    echo "offloading only) and mptx-3.1 multilibs; nvptx-none-run"
    echo "from the machine: binutils, libc6-dev, libisl23 libmpc3 libmpfr6 libgmp10 zlib1g"
    echo "libzstd1 libstdc++6 libgcc-s1 (env.sh checks them with ldd)"
    echo "unpacked_bytes $(du -sb "$prefix" | cut -f1)"
} > "$prefix/MANIFEST"

mkdir -p "$(dirname "$out")"
# xz -9: its 64 MiB dictionary reaches across the compilers, which share gcc's middle end
# (cc1, f951, the nvptx lto1): 18.3 MiB where -6's 8 MiB gave 29.5, for 40 s more
tar -C "$work" -cf - gcc12-openacc | xz -T0 -"${XZ_LEVEL:-9}" > "$out"
{ cat "$prefix/MANIFEST"; echo "archive_bytes $(stat -c %s "$out")"; } > "$(dirname "$out")/MANIFEST"
cat "$(dirname "$out")/MANIFEST"
