// plot.h: the charts of `astraictl plot` (docs/astraictl.md): a series of (step, value)
// points drawn as text for a terminal (Unicode braille, 2x4 dots a cell, or ASCII) or as a
// standalone SVG. Pure functions of their input (no I/O, no terminal queries), so that the
// tests can draw any series at any size.
#pragma once
#include <stdbool.h>
#include <stddef.h>

typedef struct {
    long step;
    double value; // NaN or an infinity: a gap in the curve (never scaled)
} PlotPoint;

typedef struct {
    const char *title;       // the first line (UTF-8): job, name, metric, last value, state
    const PlotPoint *points; // (n,) by ascending step
    size_t n;
} PlotSeries;

#define PLOT_MIN_WIDTH 20 // cells: labels, the axis and a few columns of curve
#define PLOT_MIN_HEIGHT 6 // lines: title, three rows (the y ticks), the x axis and its labels

// The terminal chart, `height` lines (fewer when the series has no finite value: the title
// and a line saying so) of at most `width` display cells each, every line ending in '\n':
// the title (cut to the width), a y axis with the min, middle and max values, the curve,
// and an x axis with step numbers. utf8: braille dots and box-drawing axes (needs an UTF-8
// LC_CTYPE for the title's cell widths), else ASCII only. width >= PLOT_MIN_WIDTH, height
// >= PLOT_MIN_HEIGHT. A malloc'd string, NULL when out of memory.
char *plot_text(const PlotSeries *s, int width, int height, bool utf8);

// The same chart as a standalone SVG document of width x height pixels: the title, axes with
// the same tick values, one path through the finite points (a new subpath after each gap; a
// point alone between gaps also gets a circle). A malloc'd string, NULL when out of memory.
char *plot_svg(const PlotSeries *s, int width, int height);
