// The dashboard's figures, for `testnet bench dashboard` (which starts the node):
//
//   node paint.mjs URL PROVIDERS RUNS
//
// Opens the page RUNS times in fresh tabs and measures first contentful paint and the
// time until every view shows its data (the network view with PROVIDERS rows). Then
// keeps one page open, prints "OPEN", and for each line "JOB <n> <unix_ms> <job_id>" on
// stdin (the bench submitted job number n at that moment) waits until the jobs view
// lists that job and prints "SEEN <n> <ms since the submission>". Prints one JSON line at the end
// of stdin.
import puppeteer from "puppeteer-core";
import { createInterface } from "node:readline";
import { existsSync } from "node:fs";

const [url, providers, runs] = process.argv.slice(2);
const executablePath = process.env.CHROMIUM
  || ["/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"].find(existsSync);
if (!url || !executablePath) {
  console.error("usage: node paint.mjs URL PROVIDERS RUNS (and chromium: scripts/install-deps.sh)");
  process.exit(2);
}
const browser = await puppeteer.launch({ executablePath, headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"] });
const paints = [], shown = [];
try {
  // Sign in once (the link sets the cookie), then time fresh loads of the page.
  const login = await browser.newPage();
  await login.goto(url, { waitUntil: "domcontentloaded" });
  await login.close();
  const origin = new URL(url).origin;
  for (let i = 0; i < Number(runs || 5); i++) {
    const page = await browser.newPage();
    await page.setViewport({ width: 1280, height: 900 });
    const t0 = Date.now();
    await page.goto(origin + "/#network", { waitUntil: "domcontentloaded" });
    await page.waitForFunction((n) => {
      const loaded = document.body.dataset.loaded || "";
      return ["network", "machine", "jobs", "credits", "utilization"].every((v) => loaded.includes(v))
        && document.querySelectorAll("#providers tbody tr[data-peer]").length >= n;
    }, { timeout: 60000, polling: 5 }, Number(providers));
    shown.push(Date.now() - t0);
    paints.push(await page.evaluate(() => {
      const p = performance.getEntriesByType("paint").find((e) => e.name === "first-contentful-paint");
      return p ? p.startTime : null;
    }));
    await page.close();
  }
  const page = await browser.newPage();
  await page.goto(origin + "/#jobs", { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => document.getElementById("live").textContent === "live", { timeout: 20000 });
  console.log("OPEN");
  const updates = [];
  for await (const line of createInterface({ input: process.stdin })) {
    const [word, n, at, job] = line.trim().split(" ");
    if (word !== "JOB") continue;
    await page.waitForFunction((id) => document.querySelector(`#my-jobs tbody tr[data-job="${id}"]`) !== null,
      { timeout: 20000, polling: 5 }, job);
    const ms = Date.now() - Number(at);
    updates.push(ms);
    console.log(`SEEN ${n} ${ms}`);
  }
  console.log(JSON.stringify({ first_paint_ms: paints, data_shown_ms: shown, sse_update_ms: updates }));
} finally {
  await browser.close();
}
