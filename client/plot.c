// plot.c: the charts of `astraictl plot` (plot.h). Both drawings share one Scale (the
// ranges of the series and the tick labels), so the terminal and the SVG say the same.
// Each is printed to a memory stream (open_memstream): its one error check is at the end.
#include "client/plot.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

#include "client/text.h"

#define LABEL_MAX 32
#define TICKS 3 // bottom, middle, top (and first, middle, last step)

typedef struct {
    size_t finite;                  // points with a finite value: none, nothing to scale
    long x_lo, x_hi;                // first and last step
    double y_lo, y_hi;              // the finite values' range, widened when they are all one
    char y_label[TICKS][LABEL_MAX]; // values at the bottom, middle and top
    char x_label[TICKS][LABEL_MAX]; // first, middle and last step
} Scale;

// Where step lies along the x range, in [0, 1]; the middle when the range is one step.
static double x_frac(const Scale *sc, long step) {
    return sc->x_hi > sc->x_lo ? (double)(step - sc->x_lo) / (double)(sc->x_hi - sc->x_lo) : 0.5;
}

// Where v lies along the y range, 0 at the bottom, 1 at the top (halves: no overflow near
// DBL_MAX).
static double y_frac(const Scale *sc, double v) {
    return (v / 2 - sc->y_lo / 2) / (sc->y_hi / 2 - sc->y_lo / 2);
}

static double y_tick(const Scale *sc, int k) {
    return k == 0 ? sc->y_lo : k == 2 ? sc->y_hi : sc->y_lo / 2 + sc->y_hi / 2;
}

static void scale_of(const PlotSeries *s, Scale *sc) {
    *sc = (Scale){0};
    for (size_t i = 0; i < s->n; i++) {
        double v = s->points[i].value;
        if (!isfinite(v)) continue;
        if (!sc->finite++ || v < sc->y_lo) sc->y_lo = v;
        if (sc->finite == 1 || v > sc->y_hi) sc->y_hi = v;
    }
    if (!sc->finite) return;
    sc->x_lo = s->points[0].step;
    sc->x_hi = s->points[s->n - 1].step;
    if (sc->y_lo == sc->y_hi) { // one value: a band around it, the curve in the middle
        double pad = sc->y_lo != 0 ? fabs(sc->y_lo) / 10 : 1;
        sc->y_lo -= pad;
        sc->y_hi += pad;
    }
    // %g with the fewest digits (4 to 10) that tell the three ticks apart: a label is at most
    // 17 characters ("-1.797693135e+308"), so a 20-cell chart keeps 2 columns for its curve
    for (int digits = 4; digits <= 10; digits++) {
        for (int k = 0; k < TICKS; k++)
            snprintf(sc->y_label[k], LABEL_MAX, "%.*g", digits, y_tick(sc, k));
        if (strcmp(sc->y_label[0], sc->y_label[1]) && strcmp(sc->y_label[1], sc->y_label[2])) break;
    }
    long x_ticks[TICKS] = {sc->x_lo, sc->x_lo + (sc->x_hi - sc->x_lo) / 2, sc->x_hi};
    for (int k = 0; k < TICKS; k++)
        snprintf(sc->x_label[k], LABEL_MAX, "%ld", x_ticks[k]);
}

// The display cells of a printable code point, -1 for a control character, one that cannot
// be shown (wcwidth needs an UTF-8 LC_CTYPE) or, without utf8, any non-ASCII one.
static int cell_width(uint32_t cp, bool utf8) {
    if (cp < 0x20 || (cp >= 0x7F && cp <= 0x9F)) return -1; // C0, DEL, C1
    if (cp < 0x80) return 1;
    return utf8 ? wcwidth((wchar_t)cp) : -1;
}

// Prints text cut to max_cells display cells, each character that cannot be shown as '?'
// (a job name never moves the cursor or sends an escape sequence).
static void put_cells(FILE *f, const char *text, int max_cells, bool utf8) {
    int cells = 0;
    for (const unsigned char *p = (const unsigned char *)text; *p;) {
        uint32_t cp = 0;
        size_t len = utf8_decode(p, &cp);
        int w = len ? cell_width(cp, utf8) : -1;
        if (cells + (w < 0 ? 1 : w) > max_cells) break;
        if (w < 0)
            fputc('?', f);
        else
            fwrite(p, 1, len, f);
        cells += w < 0 ? 1 : w;
        p += len ? len : 1;
    }
}

// Closes f, the stream open_memstream made on *text: the text printed, or NULL (and it
// freed) when printing or closing failed (memory).
static char *close_stream(FILE *f, char **text) {
    int failed = ferror(f);
    if (fclose(f) || failed) {
        free(*text);
        return NULL;
    }
    return *text;
}

// ---------------------------------------------------------------- the terminal chart

// Cells of dx x dy dots: braille 2x4, ASCII 1x2 (' . : characters).
typedef struct {
    int w, h, dx, dy;
    unsigned char *bits; // (h, w): the dots set in each cell
} Canvas;

static const unsigned char BRAILLE_BIT[4][2] = {
    {0x01, 0x08}, {0x02, 0x10}, {0x04, 0x20}, {0x40, 0x80}}; // [dot row][dot column]

static void dot(Canvas *c, int x, int y) { // y: 0 at the top
    unsigned char *cell = &c->bits[(size_t)(y / c->dy) * (size_t)c->w + (size_t)(x / c->dx)];
    *cell |= c->dy == 4 ? BRAILLE_BIT[y % 4][x % 2] : (unsigned char)(1u << (y % 2));
}

// The dots of the segment (x0, y0)-(x1, y1) (Bresenham).
static void segment(Canvas *c, int x0, int y0, int x1, int y1) {
    int dx = abs(x1 - x0), dy = -abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    for (int e = dx + dy;;) {
        dot(c, x0, y0);
        if (x0 == x1 && y0 == y1) return;
        int e2 = 2 * e;
        if (e2 >= dy) e += dy, x0 += sx;
        if (e2 <= dx) e += dx, y0 += sy;
    }
}

// The curve: segments between consecutive finite points, a lone point (gaps around it)
// one dot.
static void draw_curve(const PlotSeries *s, const Scale *sc, Canvas *c) {
    int w = c->w * c->dx, h = c->h * c->dy, have_prev = 0, px = 0, py = 0;
    for (size_t i = 0; i < s->n; i++) {
        double v = s->points[i].value;
        if (!isfinite(v)) {
            have_prev = 0;
            continue;
        }
        // clamped: a series out of step order must not draw outside the canvas
        int x = (int)lround(fmin(fmax(x_frac(sc, s->points[i].step), 0), 1) * (w - 1));
        int y = (int)lround((1 - fmin(fmax(y_frac(sc, v), 0), 1)) * (h - 1));
        if (have_prev)
            segment(c, px, py, x, y);
        else
            dot(c, x, y);
        px = x, py = y, have_prev = 1;
    }
}

static void put_cell(FILE *f, unsigned char bits, bool braille) {
    if (!bits)
        fputc(' ', f);
    else if (!braille)
        fputc(bits == 3 ? ':' : bits == 1 ? '\'' : '.', f);
    else // U+2800 + bits
        fprintf(f, "%c%c%c", 0xE2, 0xA0 | bits >> 6, 0x80 | (bits & 0x3F));
}

// The x labels under a plot of w cells: the first step at the left, the last at the right,
// the middle one centred, each only where it fits without touching another.
static void put_x_labels(FILE *f, const Scale *sc, int indent, int w) {
    char line[1024];
    if (w >= (int)sizeof line) w = (int)sizeof line - 1;
    memset(line, ' ', (size_t)w);
    line[w] = 0;
    int starts[TICKS], lens[TICKS], placed[TICKS] = {0};
    for (int k = 0; k < TICKS; k++)
        lens[k] = (int)strlen(sc->x_label[k]);
    starts[0] = 0;
    starts[2] = w - lens[2];
    starts[1] = w / 2 - lens[1] / 2;
    int order[TICKS] = {0, 2, 1};
    if (sc->x_lo == sc->x_hi) order[0] = order[1] = 1; // one step: its label in the middle
    for (int i = 0; i < TICKS; i++) {
        int k = order[i], end = starts[k] + lens[k], fits = starts[k] >= 0 && end <= w;
        for (int m = 0; m < TICKS && fits; m++)
            fits = !placed[m] || m == k || end + 1 <= starts[m] ||
                   starts[m] + lens[m] + 1 <= starts[k];
        if (fits && !placed[k]) {
            memcpy(line + starts[k], sc->x_label[k], (size_t)lens[k]);
            placed[k] = 1;
        }
    }
    while (w > 0 && line[w - 1] == ' ') // no trailing spaces
        line[--w] = 0;
    fprintf(f, "%*s%s\n", indent, "", line);
}

// The rows of the plot, each its y label (at the three ticks), the axis and its cells up to
// the last one with a dot; then the x axis.
static void put_plot_rows(FILE *f, const Scale *sc, const Canvas *c, int label_w, bool utf8) {
    int tick_row[TICKS] = {c->h - 1, (int)lround(0.5 * (c->h * c->dy - 1)) / c->dy, 0};
    for (int r = 0; r < c->h; r++) {
        int k = 0;
        while (k < TICKS && tick_row[k] != r)
            k++;
        const unsigned char *row = &c->bits[(size_t)r * (size_t)c->w];
        int used = c->w;
        while (used > 0 && !row[used - 1])
            used--;
        fprintf(f, "%*s%s", label_w, k < TICKS ? sc->y_label[k] : "",
                k < TICKS ? (utf8 ? "┤" : "+") : (utf8 ? "│" : "|"));
        for (int x = 0; x < used; x++)
            put_cell(f, row[x], utf8);
        fputc('\n', f);
    }
    fprintf(f, "%*s%s", label_w, "", utf8 ? "└" : "+");
    for (int x = 0; x < c->w; x++)
        fputs(utf8 ? "─" : "-", f);
    fputc('\n', f);
}

char *plot_text(const PlotSeries *s, int width, int height, bool utf8) {
    Scale sc;
    scale_of(s, &sc);
    char *text = NULL;
    size_t len;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    put_cells(f, s->title, width, utf8);
    fputc('\n', f);
    if (!sc.finite) {
        fputs(s->n ? "no finite values yet\n" : "no steps yet\n", f);
        return close_stream(f, &text);
    }
    int label_w = 0;
    for (int k = 0; k < TICKS; k++)
        if ((int)strlen(sc.y_label[k]) > label_w) label_w = (int)strlen(sc.y_label[k]);
    Canvas c = {.w = width - label_w - 1, .h = height - 3, .dx = utf8 ? 2 : 1, .dy = utf8 ? 4 : 2};
    c.bits = calloc((size_t)c.w * (size_t)c.h, 1);
    if (!c.bits) {
        fclose(f);
        free(text);
        return NULL;
    }
    draw_curve(s, &sc, &c);
    put_plot_rows(f, &sc, &c, label_w, utf8);
    put_x_labels(f, &sc, label_w + 1, c.w);
    free(c.bits);
    return close_stream(f, &text);
}

// ---------------------------------------------------------------- SVG

#define SVG_LEFT 90
#define SVG_RIGHT 30
#define SVG_TOP 44
#define SVG_BOTTOM 44
#define SVG_COLOR "#1f6fb4"

// Whether a title in XML may hold the code point: XML 1.0's Char production without its
// tab, newline and carriage return (a title is one line).
static bool xml_title_char(uint32_t cp) {
    return (cp >= 0x20 && cp <= 0xD7FF) || (cp >= 0xE000 && cp <= 0xFFFD) ||
           (cp >= 0x10000 && cp <= 0x10FFFF);
}

// Text as XML character data: markup escaped; a character XML 1.0 cannot hold (a control,
// U+FFFE, U+FFFF), a tab or a line break, and each byte of invalid UTF-8 as U+FFFD, so
// that the SVG always parses.
static void put_xml(FILE *f, const char *text) {
    for (const unsigned char *p = (const unsigned char *)text; *p;) {
        uint32_t cp = 0;
        size_t len = utf8_decode(p, &cp);
        const char *esc = !len || !xml_title_char(cp) ? "\xef\xbf\xbd"
                          : cp == '&'                 ? "&amp;"
                          : cp == '<'                 ? "&lt;"
                          : cp == '>'                 ? "&gt;"
                          : cp == '"'                 ? "&quot;"
                          : cp == '\''                ? "&apos;"
                                                      : NULL;
        if (esc)
            fputs(esc, f);
        else
            fwrite(p, 1, len, f);
        p += len ? len : 1;
    }
}

static void put_svg_axes(FILE *f, const Scale *sc, double pw, double ph) {
    fprintf(f,
            "<path d=\"M%d %d V%.1f H%.1f\" fill=\"none\" stroke=\"#444\"/>\n"
            "<g font-size=\"12\" fill=\"#222\">\n",
            SVG_LEFT, SVG_TOP, SVG_TOP + ph, SVG_LEFT + pw);
    for (int k = 0; k < TICKS; k++) {
        double y = SVG_TOP + (1 - y_frac(sc, y_tick(sc, k))) * ph;
        fprintf(f,
                "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#444\"/>"
                "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                SVG_LEFT - 5, y, SVG_LEFT, y, SVG_LEFT - 8, y + 4, sc->y_label[k]);
    }
    long x_ticks[TICKS] = {sc->x_lo, sc->x_lo + (sc->x_hi - sc->x_lo) / 2, sc->x_hi};
    for (int k = 0; k < TICKS; k++) {
        if (sc->x_lo == sc->x_hi && k != 1) continue; // one step: one tick, in the middle
        double x = SVG_LEFT + x_frac(sc, x_ticks[k]) * pw;
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                x, SVG_TOP + ph, x, SVG_TOP + ph + 5, x, SVG_TOP + ph + 20, sc->x_label[k]);
    }
    fputs("</g>\n", f);
}

// One path through the finite points (a new subpath after each gap), then a circle for each
// point alone between gaps (a subpath of one point draws nothing).
static void put_svg_curve(FILE *f, const PlotSeries *s, const Scale *sc, double pw, double ph) {
    fprintf(f,
            "<path class=\"curve\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" "
            "stroke-linejoin=\"round\" d=\"",
            SVG_COLOR);
    for (int circles = 0; circles < 2; circles++) {
        const char *sep = "";
        for (size_t i = 0; i < s->n; i++) {
            if (!isfinite(s->points[i].value)) continue;
            int after_gap = i == 0 || !isfinite(s->points[i - 1].value);
            int before_gap = i + 1 == s->n || !isfinite(s->points[i + 1].value);
            double x = SVG_LEFT + x_frac(sc, s->points[i].step) * pw;
            double y = SVG_TOP + (1 - y_frac(sc, s->points[i].value)) * ph;
            if (!circles)
                fprintf(f, "%s%c%.2f %.2f", sep, after_gap ? 'M' : 'L', x, y);
            else if (after_gap && before_gap)
                fprintf(f, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\" fill=\"%s\"/>\n", x, y,
                        SVG_COLOR);
            sep = " ";
        }
        if (!circles) fputs("\"/>\n", f);
    }
}

char *plot_svg(const PlotSeries *s, int width, int height) {
    Scale sc;
    scale_of(s, &sc);
    double pw = width - SVG_LEFT - SVG_RIGHT, ph = height - SVG_TOP - SVG_BOTTOM;
    char *text = NULL;
    size_t len;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    fprintf(f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n<title>",
            width, height, width, height);
    put_xml(f, s->title);
    fprintf(f,
            "</title>\n<rect width=\"%d\" height=\"%d\" fill=\"#fff\"/>\n"
            "<text x=\"%d\" y=\"26\" font-size=\"15\" fill=\"#111\">",
            width, height, SVG_LEFT);
    put_xml(f, s->title);
    fputs("</text>\n", f);
    if (!sc.finite) {
        fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"13\" fill=\"#666\">%s</text>\n", SVG_LEFT,
                SVG_TOP + 30, s->n ? "no finite values yet" : "no steps yet");
    } else {
        put_svg_axes(f, &sc, pw, ph);
        put_svg_curve(f, s, &sc, pw, ph);
    }
    fputs("</svg>\n", f);
    return close_stream(f, &text);
}
