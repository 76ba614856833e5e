// A list's "select all" box ticks or clears every email of its form. Here rather than inline:
// the Content-Security-Policy runs no inline script.
document.addEventListener("change", (event) => {
  const box = event.target;
  if (!box.matches("input[data-select-all]")) return;
  for (const email of box.form.querySelectorAll("input[name=email_id]")) email.checked = box.checked;
});
