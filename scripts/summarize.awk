# summarize.awk prints, for every Go benchmark line's name and unit in its input, the median and
# [min – max] over the runs, in first-seen order: name, median, unit, [min – max], n (tab-separated
# with -v tsv=1). bench.sh and bench-compare.sh use it.
/^Benchmark/ {
  for (i = 3; i < NF; i += 2) {
    key = $1 "\t" $(i + 1); n[key]++; v[key, n[key]] = $i
    if (!(key in seen)) { seen[key] = 1; order[++k] = key }
  }
}
function num(x) { return (x >= 100 || x <= -100) ? sprintf("%.0f", x) : sprintf("%.4g", x) }
END {
  for (j = 1; j <= k; j++) {
    key = order[j]; m = n[key]
    for (a = 1; a <= m; a++) s[a] = v[key, a] + 0
    for (a = 2; a <= m; a++) for (b = a; b > 1 && s[b - 1] > s[b]; b--) { t = s[b]; s[b] = s[b - 1]; s[b - 1] = t }
    med = (m % 2) ? s[(m + 1) / 2] : (s[m / 2] + s[m / 2 + 1]) / 2
    split(key, p, "\t")
    if (tsv) printf "%s\t%s\t%s\t[%s – %s]\tn=%d\n", p[1], num(med), p[2], num(s[1]), num(s[m]), m
    else printf "%-62s %14s %-20s [%s – %s] n=%d\n", p[1], num(med), p[2], num(s[1]), num(s[m]), m
  }
}
