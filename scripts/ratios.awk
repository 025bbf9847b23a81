# ratios.awk prints, for every Go benchmark line's name and unit found both in oldf and in its input
# (the new commit's lines), the ratio of the medians new/old and the range of the per-round ratios:
# the i-th line of a name in the input over the i-th line of that name in oldf, so each ratio pairs
# runs made minutes apart rather than the best of one commit with the worst of the other.
# bench-compare.sh uses it.
function collect(line, into, cnt,    f, n, i, key) {
  n = split(line, f, /[ \t]+/)
  for (i = 3; i < n; i += 2) {
    key = f[1] "\t" f[i + 1]
    cnt[key]++
    into[key, cnt[key]] = f[i] + 0
  }
}
function median(a, m,    s, i, j, t) {
  for (i = 1; i <= m; i++) s[i] = a[i]
  for (i = 2; i <= m; i++) for (j = i; j > 1 && s[j - 1] > s[j]; j--) { t = s[j]; s[j] = s[j - 1]; s[j - 1] = t }
  return (m % 2) ? s[(m + 1) / 2] : (s[m / 2] + s[m / 2 + 1]) / 2
}
BEGIN {
  while ((getline line < oldf) > 0) if (line ~ /^Benchmark/) collect(line, ov, on)
}
/^Benchmark/ {
  collect($0, nv, nn)
  n = split($0, f, /[ \t]+/)
  for (i = 3; i < n; i += 2) { key = f[1] "\t" f[i + 1]; if (!(key in seen)) { seen[key] = 1; order[++k] = key } }
}
END {
  for (j = 1; j <= k; j++) {
    key = order[j]
    if (!(key in on)) continue
    m = nn[key] < on[key] ? nn[key] : on[key]
    delete a; delete b; lo = ""; hi = ""
    for (i = 1; i <= m; i++) {
      a[i] = nv[key, i]; b[i] = ov[key, i]
      if (b[i] == 0) continue
      r = a[i] / b[i]
      if (lo == "" || r < lo) lo = r
      if (hi == "" || r > hi) hi = r
    }
    mo = median(b, m)
    split(key, p, "\t")
    if (mo == 0) { printf "%-66s %-22s -\n", p[1], p[2]; continue }
    printf "%-66s %-22s %6.3f [%.3f – %.3f] n=%d\n", p[1], p[2], median(a, m) / mo, lo, hi, m
  }
}
