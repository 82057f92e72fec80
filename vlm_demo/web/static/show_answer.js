// After Ask: the answer's start in view together with the question it answers. Right above the stage strip,
// #history holds the earlier turns and (once the page has it) the asked question's line, so the scroll
// keeps room above the strip for them (at most a fifth of the screen). On a phone the columns stack and
// the panels sit below the inputs: that room and the strip come to the top of the screen. Side by side
// (desktop) the page scrolls only when the strip or the room above it is out of view, and never past the
// question box's top: the visitor types the next question there while this one is answered.
() => {
    const strip = document.getElementById('stages');
    const ask = document.getElementById('ask');
    const history = document.getElementById('history');
    const box = document.getElementById('q');
    if (!strip || !ask || !history || !box) return;
    const top = strip.getBoundingClientRect().top;
    const head = Math.max(history.getBoundingClientRect().top, top - window.innerHeight * 0.2);
    const stacked = top >= ask.getBoundingClientRect().bottom;
    if (stacked) {
        if (Math.abs(head) > 8) window.scrollBy({top: head, behavior: 'smooth'});
        return;
    }
    if (head >= 0 && top <= window.innerHeight * 0.5) return;
    const by = Math.min(head - 8, box.getBoundingClientRect().top - 8);
    if (by !== 0) window.scrollBy({top: by, behavior: 'smooth'});
}
