// After Ask. On a phone the columns stack and the panels sit below the inputs: bring the stage strip (and
// the status line under it) to the top of the screen so the visitor sees the answer start. Side by side
// (desktop) the page only scrolls when the strip is out of view.
() => {
    const strip = document.getElementById('stages');
    const ask = document.getElementById('ask');
    if (!strip || !ask) return;
    const top = strip.getBoundingClientRect().top;
    const stacked = top >= ask.getBoundingClientRect().bottom;
    if (stacked ? Math.abs(top) > 8 : top < 0 || top > window.innerHeight * 0.5) {
        strip.scrollIntoView({behavior: 'smooth', block: 'start'});
    }
}
