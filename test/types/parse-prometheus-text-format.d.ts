// The package ships no declarations; its output is prom2json's shape.
declare module 'parse-prometheus-text-format' {
  export interface PrometheusMetricFamily {
    name: string
    help: string
    type: 'COUNTER' | 'GAUGE' | 'HISTOGRAM' | 'SUMMARY' | 'UNTYPED'
    // Counters and gauges: { value, labels }; histograms: { buckets, count, sum, labels }.
    metrics: Array<Record<string, any>>
  }
  export default function parsePrometheusTextFormat(text: string): PrometheusMetricFamily[]
}
