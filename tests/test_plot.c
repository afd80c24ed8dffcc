// The charts of `astraictl plot` (client/plot.h) at every width from 40 to 200 cells and
// several heights, braille and ASCII: no line wider than the width in display cells, the
// y axis's labels are the series' min and max, the x axis's its first and last step, the
// curve is drawn (continuous where the series is, gaps where it has NaN/Inf), and the SVG
// has one path point per finite value. `test_plot --svg-dir DIR` also writes each case's
// SVG to DIR (tests/test_astraictl_plot.py parses them as XML).
#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

#include "check.h"
#include "client/plot.h"

#define MAX_POINTS 400

typedef struct {
    const char *name;
    size_t n;
    PlotPoint p[MAX_POINTS];
    size_t gap_lo, gap_hi; // points [gap_lo, gap_hi) are NaN/Inf (gap_hi 0: none)
} Case;

// A title that must be cut by cells (wide characters) and never sends its escape sequence.
static const char *TITLE = "job 7 \xe8\xae\xad\xe7\xbb\x83<&>\x1b[2J | loss 1.5 | running | "
                           "restarts 2 | a long tail to cut at the narrow widths";

static void make_cases(Case *cs, size_t *n_cases) {
    size_t k = 0;
    cs[k] = (Case){.name = "empty"};
    k++;
    cs[k] = (Case){.name = "one", .n = 1, .p = {{42, 3.25}}};
    k++;
    Case *c = &cs[k++];
    *c = (Case){.name = "falling", .n = 300};
    for (size_t i = 0; i < c->n; i++)
        c->p[i] = (PlotPoint){(long)i + 1, 5.5 * exp(-(double)i / 80) + 0.3 * sin((double)i)};
    c = &cs[k++];
    *c = (Case){.name = "gaps", .n = 300, .gap_lo = 100, .gap_hi = 200};
    for (size_t i = 0; i < c->n; i++) {
        double v = 2 + cos((double)i / 30);
        if (i >= c->gap_lo && i < c->gap_hi)
            v = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
        c->p[i] = (PlotPoint){(long)(i * 10 + 5), v};
    }
    c = &cs[k++];
    *c = (Case){.name = "constant", .n = 50};
    for (size_t i = 0; i < c->n; i++)
        c->p[i] = (PlotPoint){(long)i + 1, 0.125};
    c = &cs[k++];
    *c = (Case){.name = "negative", .n = 120};
    for (size_t i = 0; i < c->n; i++)
        c->p[i] = (PlotPoint){(long)i + 1000, -1e-4 * (double)(i + 1) - 0.5};
    c = &cs[k++];
    *c = (Case){.name = "all_nan", .n = 3, .p = {{1, NAN}, {2, INFINITY}, {3, NAN}}};
    *n_cases = k;
}

static int finite_count(const Case *c) {
    int n = 0;
    for (size_t i = 0; i < c->n; i++)
        n += isfinite(c->p[i].value) != 0;
    return n;
}

static void range(const Case *c, double *lo, double *hi) {
    *lo = INFINITY, *hi = -INFINITY;
    for (size_t i = 0; i < c->n; i++)
        if (isfinite(c->p[i].value)) {
            *lo = fmin(*lo, c->p[i].value);
            *hi = fmax(*hi, c->p[i].value);
        }
}

// Decodes one UTF-8 character (the output is valid UTF-8: checked by its cells).
static size_t decode(const char *s, uint32_t *cp) {
    const unsigned char *p = (const unsigned char *)s;
    size_t len = p[0] < 0x80 ? 1 : p[0] < 0xE0 ? 2 : p[0] < 0xF0 ? 3 : 4;
    *cp = len == 1 ? p[0] : p[0] & (0x7F >> len);
    for (size_t i = 1; i < len; i++)
        *cp = *cp << 6 | (p[i] & 0x3F);
    return len;
}

typedef struct {
    char *line[256];
    int n;
} Lines;

static void split(char *text, Lines *l) {
    l->n = 0;
    for (char *p = text; *p && l->n < 256;) {
        char *nl = strchr(p, '\n');
        if (!nl) break;
        *nl = 0;
        l->line[l->n++] = p;
        p = nl + 1;
    }
}

static int cells(const char *line) {
    int n = 0;
    for (const char *p = line; *p;) {
        uint32_t cp;
        p += decode(p, &cp);
        int w = wcwidth((wchar_t)cp);
        n += w < 0 ? 1000 : w; // an unprintable character: never allowed
    }
    return n;
}

// Dots of the plot row: braille bits, or ASCII ' . : (two dots).
static int row_dots(const char *row, bool utf8, int *first_col, int *last_col, int from_col) {
    int dots = 0, col = 0;
    for (const char *p = row; *p; col++) {
        uint32_t cp;
        p += decode(p, &cp);
        int d = 0;
        if (utf8 && cp > 0x2800 && cp <= 0x28FF) d = __builtin_popcount(cp - 0x2800);
        if (!utf8 && col >= from_col) d = cp == ':' ? 2 : cp == '.' || cp == '\'';
        if (d && *first_col < 0) *first_col = col;
        if (d) *last_col = col;
        dots += d;
    }
    return dots;
}

// The label of a tick row: the number before the axis.
static double label_value(const char *row) {
    return strtod(row, NULL);
}

static void check_text(const Case *c, int width, int height, bool utf8) {
    PlotSeries s = {TITLE, c->p, c->n};
    char *text = plot_text(&s, width, height, utf8);
    CHECK(text != NULL);
    if (!text) return;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++)
        CHECK_MSG(*p >= 0x20 || *p == '\n', "%s: control byte 0x%02x", c->name, *p);
    if (!utf8)
        for (const unsigned char *p = (const unsigned char *)text; *p; p++)
            CHECK_MSG(*p < 0x80, "%s: non-ASCII byte in an ASCII chart", c->name);
    Lines l;
    split(text, &l);
    for (int i = 0; i < l.n; i++)
        CHECK_MSG(cells(l.line[i]) <= width, "%s width %d: line %d is %d cells: %s", c->name, width,
                  i, cells(l.line[i]), l.line[i]);
    CHECK(l.n >= 2 && !strncmp(l.line[0], "job 7 ", 6));
    CHECK(!strstr(text, "[2J") || strstr(text, "?[2J"));
    int finite = finite_count(c);
    if (!finite) {
        CHECK_MSG(l.n == 2 && strstr(l.line[1], c->n ? "no finite values" : "no steps yet"),
                  "%s: %s", c->name, l.n > 1 ? l.line[1] : "(no line)");
        free(text);
        return;
    }
    CHECK_MSG(l.n == height, "%s: %d lines, height %d", c->name, l.n, height);
    const char *tick = utf8 ? "\xe2\x94\xa4" : "+"; // ┤
    int rows = height - 3, ticks = 0, dots = 0, first_col = -1, last_col = -1, dot_rows = 0;
    int label_w = (int)strspn(l.line[height - 2], " "); // the x axis starts at the y axis
    double top = NAN, bottom = NAN;
    for (int r = 0; r < rows; r++) {
        const char *row = l.line[1 + r];
        const char *axis = row + label_w;
        if (!strncmp(axis, tick, strlen(tick))) {
            ticks++;
            if (ticks == 1) top = label_value(row);
            bottom = label_value(row);
        }
        int row_first = -1, row_last = -1;
        int d = row_dots(axis, utf8, &row_first, &row_last, 1);
        dots += d;
        dot_rows += d > 0;
        if (row_first >= 0 && (first_col < 0 || row_first < first_col)) first_col = row_first;
        if (row_last > last_col) last_col = row_last;
    }
    CHECK_MSG(ticks == 3, "%s width %d height %d: %d y ticks", c->name, width, height, ticks);
    double lo, hi;
    range(c, &lo, &hi);
    if (lo < hi) {
        CHECK_MSG(fabs(top - hi) <= 1e-3 * fabs(hi), "%s: top label %g, max %g", c->name, top, hi);
        CHECK_MSG(fabs(bottom - lo) <= 1e-3 * fabs(lo), "%s: bottom label %g, min %g", c->name,
                  bottom, lo);
    } else { // one value: labels around it
        CHECK_MSG(top > hi && bottom < lo, "%s: labels %g..%g around %g", c->name, bottom, top, lo);
        CHECK_MSG(dot_rows == 1, "%s: a constant drawn on %d rows", c->name, dot_rows);
    }
    CHECK_MSG(dots > 0, "%s: no dot drawn", c->name);
    if (finite == 1) CHECK_MSG(dots == 1, "%s: one point drew %d dots", c->name, dots);
    // A series without gaps is one continuous curve: every column between its ends has a dot.
    int plot_w = width - label_w - 1;
    if (finite > 1 && !c->gap_hi) {
        CHECK_MSG(first_col == 1 && last_col == plot_w, "%s width %d: curve spans %d..%d of %d",
                  c->name, width, first_col, last_col, plot_w);
        for (int col = 1; col <= plot_w; col++) {
            int any = 0;
            for (int r = 0; r < rows && !any; r++) {
                int f = -1, la = -1;
                const char *p = l.line[1 + r] + label_w;
                for (int k = 0; k < col && *p; k++) { // to the column's character
                    uint32_t cp;
                    p += decode(p, &cp);
                }
                char one[8] = {0};
                uint32_t cp;
                if (*p) memcpy(one, p, decode(p, &cp));
                any = row_dots(one, utf8, &f, &la, 0) > 0;
            }
            CHECK_MSG(any, "%s width %d: no dot in column %d", c->name, width, col);
            if (!any) break;
        }
    }
    // A gap: the columns well inside it have no dot.
    if (c->gap_hi) {
        double x0 = (double)(c->p[c->gap_lo].step - c->p[0].step) /
                    (double)(c->p[c->n - 1].step - c->p[0].step),
               x1 = (double)(c->p[c->gap_hi - 1].step - c->p[0].step) /
                    (double)(c->p[c->n - 1].step - c->p[0].step);
        int c0 = 2 + (int)(x0 * plot_w), c1 = (int)(x1 * plot_w) - 1;
        for (int r = 0; r < rows; r++) {
            const char *p = l.line[1 + r] + label_w;
            int col = 0;
            while (*p) {
                uint32_t cp;
                size_t len = decode(p, &cp);
                char one[8] = {0};
                memcpy(one, p, len);
                int f = -1, la = -1;
                if (col > c0 && col < c1)
                    CHECK_MSG(row_dots(one, utf8, &f, &la, 0) == 0,
                              "%s width %d: a dot in the gap at column %d", c->name, width, col);
                p += len, col++;
            }
        }
    }
    // The x axis's labels: the first and the last step.
    char first[32], last[32];
    snprintf(first, sizeof first, "%ld", c->p[0].step);
    snprintf(last, sizeof last, "%ld", c->p[c->n - 1].step);
    const char *xl = l.line[height - 1];
    CHECK_MSG(strstr(xl, first) && strstr(xl, last), "%s width %d: x labels '%s'", c->name, width,
              xl);
    free(text);
}

// `--svg-dir DIR`: the SVG as DIR/NAME.svg, for tests/test_astraictl_plot.py to parse.
static void write_svg(const char *dir, const char *name, const char *svg) {
    if (!dir) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.svg", dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f && fputs(svg, f) >= 0 && !fclose(f));
}

// The SVG: the title escaped, one path point per finite value, a circle per lone point.
static void check_svg(const Case *c, const char *dir) {
    PlotSeries s = {TITLE, c->p, c->n};
    char *svg = plot_svg(&s, 900, 450);
    CHECK(svg != NULL);
    if (!svg) return;
    CHECK(!strncmp(svg, "<?xml", 5) && strstr(svg, "</svg>\n"));
    CHECK(strstr(svg, "&lt;&amp;&gt;\xef\xbf\xbd[2J") != NULL); // ESC as U+FFFD
    for (const unsigned char *p = (const unsigned char *)svg; *p; p++)
        CHECK_MSG(*p >= 0x20 || *p == '\n', "%s: control byte 0x%02x in the SVG", c->name, *p);
    const char *d = strstr(svg, " d=\"M");
    int points = 0;
    if (d && strstr(svg, "class=\"curve\""))
        for (const char *p = strstr(svg, "class=\"curve\""); *p && *p != '>'; p++)
            points += *p == 'M' || *p == 'L';
    CHECK_MSG(points == finite_count(c), "%s: %d path points for %d finite values", c->name, points,
              finite_count(c));
    if (finite_count(c) == 1) CHECK(strstr(svg, "<circle") != NULL);
    write_svg(dir, c->name, svg);
    free(svg);
}

// A title with characters XML 1.0 forbids (U+FFFE, U+FFFF, a control, a tab, a surrogate
// and an overlong form encoded in UTF-8, a byte that is no UTF-8) has U+FFFD for each of
// them in the SVG, which stays XML (tests/test_astraictl_plot.py parses bad_chars.svg).
static void check_svg_bad_chars(const char *dir) {
    static const char title[] =
        "job 9 <&> a\xef\xbf\xbe b\xef\xbf\xbf c\xff d\x01 e\t f\xed\xa0\x80"
        " g\xc0\xaf h\xf0\x9f\x98\x80 \xe2\x82\xac";
    static const char want[] = "<title>job 9 &lt;&amp;&gt; a\xef\xbf\xbd b\xef\xbf\xbd "
                               "c\xef\xbf\xbd d\xef\xbf\xbd e\xef\xbf\xbd "
                               "f\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd "
                               "g\xef\xbf\xbd\xef\xbf\xbd h\xf0\x9f\x98\x80 \xe2\x82\xac</title>";
    static const PlotPoint points[] = {{1, 1.0}, {2, 0.5}};
    PlotSeries s = {title, points, 2};
    char *svg = plot_svg(&s, 900, 450);
    CHECK(svg != NULL);
    if (!svg) return;
    CHECK_MSG(strstr(svg, want) != NULL, "bad characters not replaced by U+FFFD: %.400s", svg);
    write_svg(dir, "bad_chars", svg);
    free(svg);
}

int main(int argc, char **argv) {
    const char *svg_dir = argc == 3 && !strcmp(argv[1], "--svg-dir") ? argv[2] : NULL;
    CHECK(setlocale(LC_CTYPE, "C.UTF-8") != NULL); // wcwidth of braille and CJK
    static Case cases[16];
    size_t n_cases;
    make_cases(cases, &n_cases);
    static const int heights[] = {PLOT_MIN_HEIGHT, 12, 24};
    for (size_t k = 0; k < n_cases; k++) {
        for (int width = 40; width <= 200; width++)
            for (int utf8 = 0; utf8 < 2; utf8++)
                check_text(&cases[k], width, heights[width % 3], utf8);
        check_text(&cases[k], PLOT_MIN_WIDTH, PLOT_MIN_HEIGHT, true);
        check_svg(&cases[k], svg_dir);
    }
    check_svg_bad_chars(svg_dir);
    CHECK_DONE();
}
