// What every E2B JavaScript check script here shares (as ../python/checks.py does for Python): run one
// named check, print `ok NAME` or `FAIL NAME: why` (the VM tests read those lines), and remember the
// failures so the script's exit code reports them.
export const failures = []

export async function check(name, body) {
  try {
    await body()
    console.log(`ok ${name}`)
  } catch (error) {
    failures.push(name)
    console.log(`FAIL ${name}: ${error?.name}: ${error?.message}`)
    console.error(error)
  }
}
