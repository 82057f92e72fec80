// On load. A link to the API page (?view=api) opens it: Gradio 6.31 marks its API panel open but loads the
// panel's code only when the footer's "Use via API" is hovered or clicked, so on its own the link shows the
// demo alone. Clicking that button twice (closed, then open again) loads the panel and opens it.
() => {
    if (new URLSearchParams(window.location.search).get('view') !== 'api') return;
    const button = document.querySelector('footer .show-api');
    if (!button || document.querySelector('.api-docs')) return;
    button.click();
    button.click();
}
